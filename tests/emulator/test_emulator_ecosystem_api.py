"""PopTorch's API as the libraries that wrap it use it: each test is what one of them does,
written against PopTorch alone, with plain torch's numbers to compare."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ipuloop import emulator as poptorch


class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 1)

    def forward(self, x, y):
        out = self.fc(x)
        return out, F.mse_loss(out, y)


def test_float32_weights_train_on_float16_inputs_with_a_loss_the_host_cannot_differentiate():
    """Lightning's "16-mixed" on an IPU: float32 weights, the batch cast to float16, an MSE
    loss. The device computes in float16 and trains the float32 weights; torch 2.0's CPU has
    ``mse_loss``'s float16 forward but not its backward, which the emulator computes in
    float32 as the other float16 ops the host lacks, the result rounded to float16."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    model, reference = Regression(), Regression()
    reference.load_state_dict(model.state_dict())
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    out, loss = training(x.half(), y.half())
    assert out.dtype == loss.dtype == torch.float16
    assert model.fc.weight.dtype == torch.float32

    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected = reference(x, y)[1]
    expected.backward()
    optimizer.step()
    assert abs(loss.item() - expected.item()) < 2e-3 * expected.item()
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.detach(), want.detach(), atol=1e-3, rtol=1e-3)
    # a second call runs as the traced one
    training(x.half(), y.half())

"""A pipelined model that enters a block again after later stages ran (a decoder's positional
embedding in the embeddings' block, after the encoder's stages; Transformers' encoder-decoder
models pipelined this way): the block's ops join its stage, as PopTorch puts them, so long as
they use no tensor a later stage computed (PopART's pipeline then has nowhere to take it from)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ipuloop import emulator as poptorch
from ipuloop.emulator.blocks import AutoStage, Block, PipelinedExecution, trace_stages
from ipuloop.emulator.errors import Error


def test_a_block_entered_again_takes_ops_that_use_earlier_stages_only():
    x = torch.ones(2)
    with trace_stages(PipelinedExecution(AutoStage.AutoIncrement)) as trace:
        with Block("Embedding", 0):
            a = x * 2
        with Block("Encoder", 1):
            b = a + 1
        with Block("Embedding", 0):  # uses the input and stage 1's tensor only
            c = a * x
        with Block("Decoder", 2):
            d = b + c
    assert torch.equal(d, torch.full((2,), 5.0))
    assert [s for _, s, _ in trace.blocks] == [1, 2, 1, 3]
    # PopTorch counts every IPU switch in the order the ops run: 0 -> 1 -> 0 -> 2
    assert trace.num_forward_stages == 4 and trace.ipus == {0, 1, 2}


def test_a_block_entered_again_may_not_use_a_later_stage_tensor():
    x = torch.ones(2)
    with pytest.raises(
        Error, match=r"block 'Embedding' \(stage 1\) uses a tensor computed in the later stage 2"
    ):
        with trace_stages(PipelinedExecution(AutoStage.AutoIncrement)):
            with Block("Embedding", 0):
                a = x * 2
            with Block("Encoder", 1):
                b = a + 1
            with Block("Embedding", 0):
                b * 2


def test_a_new_block_still_may_not_go_back_a_stage():
    x = torch.ones(2)
    with pytest.raises(Error, match="ascending order"):
        with trace_stages(PipelinedExecution()):
            for name, ipu in (("a", 0), ("b", 2), ("a", 0), ("c", 1)):
                with Block(name, ipu):
                    x = x * 2


class EncoderDecoder(nn.Module):
    """Embeddings on IPU 0, an encoder layer on IPU 0, a decoder layer on IPU 1 whose positions
    are embedded in the embeddings' block again, and the loss on IPU 1."""

    def __init__(self):
        super().__init__()
        self.embed = poptorch.BeginBlock(nn.Embedding(8, 4), "Embedding", ipu_id=0)
        self.positions = poptorch.BeginBlock(nn.Embedding(6, 4), "Embedding", ipu_id=0)
        self.encoder = poptorch.BeginBlock(nn.Linear(4, 4), "Encoder", ipu_id=0)
        self.decoder = poptorch.BeginBlock(Decoder(), "Decoder", ipu_id=1)

    def forward(self, src, tgt, y):
        memory = self.encoder(self.embed(src) + self.positions(torch.arange(src.shape[1])))
        queries = self.embed(tgt) + self.positions(torch.arange(tgt.shape[1]))
        out = self.decoder(queries, memory)
        return out, nn.functional.mse_loss(out, y)


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, queries, memory):
        return self.fc(queries + memory.mean(1, keepdim=True))


def test_a_pipelined_encoder_decoder_revisiting_its_embeddings_trains_as_plain_torch():
    torch.manual_seed(0)
    model = EncoderDecoder()
    ref = EncoderDecoder()
    ref.load_state_dict(model.state_dict())
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(5)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement))
    src, tgt = torch.randint(0, 8, (5, 3)), torch.randint(0, 8, (5, 2))
    y = torch.randn(5, 2, 4)
    training = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    training(src, tgt, y)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(5):  # mean of the micro-batches' gradients
        (ref(src[i : i + 1], tgt[i : i + 1], y[i : i + 1])[1] / 5).backward()
    opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, msg=name)

"""optimum-graphcore programs, written as its README shows, run unmodified on the emulator
(``python -m ipuloop.emulate``) and give the numbers that plain Transformers gives for the same
math: ``IPUTrainer`` training and evaluating a BERT pipelined over two IPUs, generation with
the encoder's output in updatable buffers (and a KV cache), and ``IPUSeq2SeqTrainer`` evaluating
with ``generate`` (which unwraps the training model and wraps it again).

Tiny models built from configs: no hub, no network. The programs run in one subprocess under
the emulator (optimum-graphcore imports ``poptorch`` at import). Skipped where
optimum-graphcore is not installed (it needs Python 3.8 and torch 2.0.1: pyproject's
``optimum-graphcore`` extra), unless ``IPULOOP_REQUIRE_ECOSYSTEM=1`` asks for it.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a library's programs in subprocesses
REPO = Path(__file__).resolve().parents[2]

try:
    OPTIMUM_GRAPHCORE = importlib.metadata.version("optimum-graphcore")
except importlib.metadata.PackageNotFoundError:
    if os.environ.get("IPULOOP_REQUIRE_ECOSYSTEM") == "1":
        raise ImportError(
            "IPULOOP_REQUIRE_ECOSYSTEM=1 but optimum-graphcore is not installed "
            "(pip install -e '.[optimum-graphcore]' in a Python 3.8 environment)"
        ) from None
    pytest.skip("optimum-graphcore is not installed", allow_module_level=True)

PROGRAM = textwrap.dedent('''
    import json, sys, tempfile, traceback
    import torch
    import poptorch
    from transformers import (BartConfig, BartForConditionalGeneration, BertConfig,
                              BertForSequenceClassification, T5Config, T5ForConditionalGeneration)
    from optimum.graphcore import (IPUConfig, IPUSeq2SeqTrainer, IPUSeq2SeqTrainingArguments,
                                   IPUTrainer, IPUTrainingArguments)
    from optimum.graphcore.modeling_utils import to_pipelined

    results = {}


    def section(fn):
        try:
            results[fn.__name__] = fn()
        except Exception:
            results[fn.__name__] = {"error": traceback.format_exc()}


    def adamw_no_bias_correction(model, lr, weight_decay, decay):
        """IPUTrainer's default optimizer (poptorch.optim.AdamW, bias_correction=False), its
        state kept on the model."""
        state = model.__dict__.setdefault("_adam", {})
        with torch.no_grad():
            for n, p in model.named_parameters():
                if p.grad is None:
                    continue
                m, v = state.setdefault(n, (torch.zeros_like(p), torch.zeros_like(p)))
                if n in decay:
                    p.mul_(1 - lr * weight_decay)
                m.mul_(0.9).add_(p.grad, alpha=0.1)
                v.mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)
                p.addcdiv_(m, v.sqrt().add_(1e-8), value=-lr)


    class Data(torch.utils.data.Dataset):
        def __init__(self, **columns):
            self.columns = columns

        def __len__(self):
            return len(next(iter(self.columns.values())))

        def __getitem__(self, i):
            return {k: v[i] for k, v in self.columns.items()}


    @section
    def trainer():
        """IPUTrainer: a BERT classifier over 2 IPUs (pipelined), 3 steps of 4 micro-batches
        of 2 (one step per epoch: the data order within a step does not change the mean
        gradient), then evaluate."""
        config = BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=4, intermediate_size=37,
                            max_position_embeddings=16, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0, num_labels=3)
        torch.manual_seed(0)
        model = BertForSequenceClassification(config)
        init = {k: v.clone() for k, v in model.state_dict().items()}
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(2, 40, (8, 8), generator=g)
        mask = torch.ones(8, 8, dtype=torch.long)
        labels = torch.randint(0, 3, (8,), generator=g)
        data = Data(input_ids=ids, attention_mask=mask, labels=labels)
        ipu_config = IPUConfig(layers_per_ipu=[1, 1], gradient_accumulation_steps=4)
        args = IPUTrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2,
                                    per_device_eval_batch_size=2, num_train_epochs=3,
                                    learning_rate=1e-2, weight_decay=0.01, fp32=True, seed=0,
                                    report_to="none", save_strategy="no")
        trainer = IPUTrainer(model=model, ipu_config=ipu_config, args=args, train_dataset=data,
                             eval_dataset=data)
        result = trainer.train()
        metrics = trainer.evaluate()
        trained = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}

        ref = BertForSequenceClassification(config)
        ref.load_state_dict(init)
        decay = {n for n, _ in ref.named_parameters() if "bias" not in n and "LayerNorm" not in n}
        for step in range(3):  # the linear schedule: 1e-2 * (1 - step / 3)
            ref.zero_grad()
            ref(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            adamw_no_bias_correction(ref, 1e-2 * (1 - step / 3), 0.01, decay)
        with torch.no_grad():
            ref_eval = ref(input_ids=ids, attention_mask=mask, labels=labels).loss.item()
        return {
            "steps": result.global_step,
            "eval_loss": metrics["eval_loss"],
            "ref_eval_loss": ref_eval,
            "weights_max_diff": max((trained[k] - v).abs().max().item()
                                    for k, v in ref.state_dict().items()),
        }


    T5 = dict(vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2,
              num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
              eos_token_id=1, initializer_factor=5.0)


    @section
    def generation():
        """A T5 pipelined over 4 IPUs for generation, the encoder's output in updatable
        buffers, without and with a KV cache: greedy search as Transformers' generate()."""
        torch.manual_seed(2)
        model = T5ForConditionalGeneration(T5Config(**T5)).eval()
        ids = torch.randint(2, 32, (2, 6), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            expected = model.generate(ids, max_length=8, do_sample=False, num_beams=1)
        out = {"expected": expected.tolist()}
        ipu_config = IPUConfig(layers_per_ipu=[1, 1, 1, 1], inference_layers_per_ipu=[1, 1, 1, 1])
        pipelined = to_pipelined(model, ipu_config).eval()
        pipelined.parallelize(for_generation=True, use_encoder_output_buffer=True)
        out["buffered"] = pipelined.encoder_output_buffer_enabled
        out["no_cache"] = pipelined.generate(ids, max_length=8, do_sample=False, num_beams=1,
                                             use_cache=False).tolist()
        pipelined.destroy()
        pipelined.deparallelize()
        pipelined.parallelize(for_generation=True, use_cache=True, max_length=8, batch_size=2,
                              num_beams=1, use_encoder_output_buffer=True)
        out["kv_cache"] = pipelined.generate(ids, max_length=8, do_sample=False,
                                             num_beams=1).tolist()
        return out


    @section
    def seq2seq():
        """IPUSeq2SeqTrainer: a BART over 2 IPUs trained 2 steps, then evaluated with
        generate() (the training model is unwrapped, reparallelized for generation, then
        wrapped again): the predictions of plain Transformers' model trained the same way."""
        config = BartConfig(vocab_size=32, d_model=16, encoder_layers=1, decoder_layers=1,
                            encoder_attention_heads=2, decoder_attention_heads=2,
                            encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
                            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                            init_std=0.5, forced_eos_token_id=None, use_cache=False)
        torch.manual_seed(2)
        model = BartForConditionalGeneration(config)
        init = {k: v.clone() for k, v in model.state_dict().items()}
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(3, 32, (8, 6), generator=g)
        mask = torch.ones(8, 6, dtype=torch.long)
        labels = torch.randint(3, 32, (8, 4), generator=g)
        predictions = []

        def compute_metrics(pred):
            predictions.append(pred.predictions.tolist())
            return {}

        ipu_config = IPUConfig(layers_per_ipu=[1, 1], gradient_accumulation_steps=8,
                               inference_layers_per_ipu=[1, 1],
                               inference_parallelize_kwargs={"use_encoder_output_buffer": True})
        args = IPUSeq2SeqTrainingArguments(
            output_dir=tempfile.mkdtemp(), per_device_train_batch_size=1,
            per_device_eval_batch_size=2, num_train_epochs=2, learning_rate=1e-2,
            weight_decay=0.0, fp32=True, seed=0, report_to="none", save_strategy="no",
            predict_with_generate=True, generation_max_length=6)
        data = Data(input_ids=ids, attention_mask=mask, labels=labels)
        trainer = IPUSeq2SeqTrainer(model=model, ipu_config=ipu_config, args=args,
                                    train_dataset=data, eval_dataset=data,
                                    compute_metrics=compute_metrics)
        trainer.train()
        trained = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        wrapped = [type(trainer.model).__name__]
        trainer.evaluate()
        wrapped.append(type(trainer.model).__name__)

        ref = BartForConditionalGeneration(config)
        ref.load_state_dict(init)
        for step in range(2):
            ref.zero_grad()
            ref(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            adamw_no_bias_correction(ref, 1e-2 * (1 - step / 2), 0.0, set())
        ref.eval()
        with torch.no_grad():
            expected = ref.generate(ids, attention_mask=mask, max_length=6, do_sample=False)
        # The keys' biases have no gradient in exact arithmetic (softmax ignores a shift common
        # to every key): Adam makes a step of their rounding noise, in either program.
        compared = [k for k in ref.state_dict() if k in trained and not k.endswith("k_proj.bias")]
        return {
            "wrapped": wrapped,
            "predictions": [row[:6] for row in predictions[0]],
            "padding": sorted({t for row in predictions[0] for t in row[6:]}),
            "expected": expected.tolist(),
            "compared": len(compared),
            "weights_max_diff": max((trained[k] - ref.state_dict()[k]).abs().max().item()
                                    for k in compared),
        }


    print("RESULTS " + json.dumps(results))
''')


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("optimum")
    (folder / "programs.py").write_text(PROGRAM)
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    p = subprocess.run(
        [sys.executable, "-m", "ipuloop.emulate", "programs.py"],
        cwd=str(folder),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-5000:]
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULTS "))
    return json.loads(line[len("RESULTS ") :])


def _ok(results, name):
    out = results[name]
    assert "error" not in out, out.get("error")
    return out


def test_ipu_trainer_trains_a_pipelined_bert_and_evaluates_as_plain_transformers(results):
    out = _ok(results, "trainer")
    assert out["steps"] == 3
    assert out["weights_max_diff"] < 1e-4
    assert out["eval_loss"] == pytest.approx(out["ref_eval_loss"], rel=1e-5)


def test_generation_with_encoder_output_buffers_is_transformers_greedy_search(results):
    out = _ok(results, "generation")
    assert out["buffered"] is True
    assert out["no_cache"] == out["expected"]
    assert out["kv_cache"] == out["expected"]


def test_seq2seq_trainer_evaluates_with_generate_and_wraps_the_model_again(results):
    out = _ok(results, "seq2seq")
    assert out["wrapped"] == ["PoptorchPipelinedBartForConditionalGeneration"] * 2
    assert out["compared"] > 20 and out["weights_max_diff"] < 1e-4
    assert out["predictions"] == out["expected"]
    assert out["padding"] in ([], [1])  # padded with the pad token to the batch's length

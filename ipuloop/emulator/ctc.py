"""``poptorch.ctc_beam_search_decoder``: CTC prefix beam search, the decoding PopLibs' decoder
runs on an IPU (validated against TensorFlow's ``ctc_beam_search_decoder``), and PopTorch's
CPU kernel outside a wrapped model."""

from __future__ import annotations

import math

import torch

from .errors import Error
from .executor import isRunningOnIpu

__all__ = ["ctc_beam_search_decoder"]

_NEG_INF = -math.inf


def _logaddexp(a: float, b: float) -> float:
    if a == _NEG_INF:
        return b
    if b == _NEG_INF:
        return a
    top = max(a, b)
    return top + math.log1p(math.exp(-abs(a - b)))


def _decode(
    log_probs: list[list[float]], blank: int, beam_width: int
) -> list[tuple[float, tuple[int, ...]]]:
    """The beams of one sequence (``log_probs[t][c]``), best first: (log probability of the
    labelling, the labelling). Each beam holds the probability of its prefix ending in a blank
    and in a label; a label repeated without a blank between merges into the prefix."""
    beams: dict[tuple[int, ...], tuple[float, float]] = {(): (0.0, _NEG_INF)}
    grown: dict[tuple[int, ...], list[float]] = {}

    def add(prefix: tuple[int, ...], ends_blank: bool, p: float) -> None:
        entry = grown.setdefault(prefix, [_NEG_INF, _NEG_INF])
        i = 0 if ends_blank else 1
        entry[i] = _logaddexp(entry[i], p)

    for step in log_probs:
        grown.clear()
        for prefix, (p_blank, p_label) in beams.items():
            total = _logaddexp(p_blank, p_label)
            last = prefix[-1] if prefix else None
            for c, p in enumerate(step):
                if c == blank:
                    add(prefix, True, total + p)
                elif c == last:
                    add((*prefix, c), False, p_blank + p)  # a repeat after a blank
                    add(prefix, False, p_label + p)  # the same label continued
                else:
                    add((*prefix, c), False, total + p)
        ranked = sorted(grown.items(), key=lambda kv: -_logaddexp(*kv[1]))[:beam_width]
        beams = {prefix: (pb, pl) for prefix, (pb, pl) in ranked}
    scored = [(_logaddexp(pb, pl), prefix) for prefix, (pb, pl) in beams.items()]
    return sorted(scored, key=lambda s: -s[0])


def ctc_beam_search_decoder(
    probs: torch.Tensor,
    lengths: torch.Tensor,
    blank: int = 0,
    beam_width: int = 100,
    top_paths: int = 1,
) -> list[torch.Tensor]:
    """The ``top_paths`` most likely labellings of each sequence of ``probs`` (log
    probabilities, [input_length, batch_size, num_classes], the first ``lengths[b]`` steps of
    sequence b): their log probabilities [batch_size, top_paths] (probs' dtype), lengths and
    labels [batch_size, top_paths, input_length] (int32, zero-padded). Outside a wrapped model
    it is PopTorch's CPU kernel: zeros of those shapes."""
    if not isinstance(probs, torch.Tensor):
        raise Error(
            "ctc_beam_search_decoder: probs must be a torch.tensor argument. "
            f"{type(probs)} is not supported."
        )
    if not isinstance(lengths, torch.Tensor):
        raise Error(
            "ctc_beam_search_decoder: lengths must be a torch.tensor argument. "
            f"{type(lengths)} is not supported."
        )
    if probs.dim() != 3:
        raise Error("Incorrect shape for first input to CTC beam search decoder.")
    steps, batch, classes = probs.shape
    if not isRunningOnIpu():
        return [
            torch.zeros(batch, top_paths),
            torch.zeros(batch, top_paths),
            torch.zeros(batch, top_paths, steps),
        ]
    if not 0 <= blank < classes:
        raise Error(
            f"ctc_beam_search_decoder: blank={blank} is not a class of probs (its "
            f"last dimension has {classes})."
        )
    if beam_width < top_paths or top_paths < 1:
        raise Error(
            f"ctc_beam_search_decoder: top_paths must be between 1 and beam_width. "
            f"Received: top_paths={top_paths}, beam_width={beam_width}."
        )
    values = probs.detach().float().cpu().permute(1, 0, 2).tolist()  # [batch][step][class]
    n = lengths.detach().cpu().reshape(-1).tolist()
    path_probs = torch.full((batch, top_paths), _NEG_INF)
    path_lens = torch.zeros(batch, top_paths, dtype=torch.int32)
    paths = torch.zeros(batch, top_paths, steps, dtype=torch.int32)
    for b in range(batch):
        best = _decode(values[b][: max(0, min(int(n[b]), steps))], blank, beam_width)
        for k, (score, labels) in enumerate(best[:top_paths]):
            path_probs[b, k] = score
            path_lens[b, k] = len(labels)
            paths[b, k, : len(labels)] = torch.tensor(labels, dtype=torch.int32)
    device = probs.device
    return [path_probs.to(device=device, dtype=probs.dtype), path_lens.to(device), paths.to(device)]

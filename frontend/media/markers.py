"""The step the processors that tern stands in for (frontend/media/qwen_vl.py, pixtral.py) share:
each image marker of the prompts' text, in order, becomes its image's text."""

from __future__ import annotations


def expand_markers(texts: list[str], marker: str, runs: list[str]) -> list[str]:
    """`texts` with their `marker`s replaced by `runs`, one each in order; ValueError unless
    markers and runs pair up one to one."""
    pending = list(runs)
    out = []
    for text in texts:
        pieces = text.split(marker)
        if len(pieces) - 1 > len(pending):
            raise ValueError(f"more image markers ({marker}) than images")
        taken, pending = pending[: len(pieces) - 1], pending[len(pieces) - 1 :]
        out.append(pieces[0] + "".join(run + piece for run, piece in zip(taken, pieces[1:])))
    if pending:
        raise ValueError(f"{len(runs)} images for {len(runs) - len(pending)} image markers")
    return out

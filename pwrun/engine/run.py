"""``pwrun generate --artifacts``: tokenize prompts, build the engine, serve them all, report.

What it does: the plain function behind the command (and the notebooks/tests): encodes prompts
(checking each fits the model's context with its generation), builds the engine for the budget
and policy, streams text through ``on_text`` as tokens are sampled, and returns one
``Generation`` per prompt plus the summary dict. Nothing is dropped: every request runs to EOS
or ``max_new_tokens``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pwrun.engine.report import summarize, write_trace
from pwrun.engine.scheduler import Sequence
from pwrun.engine.serve import ServeConfig, build_engine
from pwrun.errors import PagedWeightError
from pwrun.generate import Generation, encode_prompts
from pwrun.model.loader import load_spec
from pwrun.sampling import SamplingParams


def serve_prompts(model_dir: Path, artifact_dir: Path, prompts: list[str], tokenizer: Any, cfg: ServeConfig,
                  params: SamplingParams, device: str = "auto", dtype: str = "auto",
                  on_text: Callable[[int, str], None] | None = None, trace: Path | None = None,
                  on_progress: Callable[[int, int], None] | None = None
                  ) -> tuple[list[Generation], dict[str, Any]]:
    """Serve ``prompts`` under ``cfg``; returns generations (in prompt order) and the run summary.

    ``on_progress(finished requests, generated tokens)`` is called after every sampled token. A ``trace`` that
    cannot be written does not lose the generations: the summary's ``trace_error`` says why.
    """
    spec, _ = load_spec(Path(model_dir))
    ids = encode_prompts(tokenizer, prompts, spec.max_position_embeddings, params.max_new_tokens)
    eos = set(spec.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        eos.add(int(tokenizer.eos_token_id))
    built = build_engine(Path(model_dir), Path(artifact_dir), cfg, params, ids, eos, device, dtype)
    engine = built.engine
    printed = [""] * len(prompts)

    def emit(s: Sequence) -> None:
        if on_text is None:
            return
        text = tokenizer.decode(s.out, skip_special_tokens=True)
        if len(text) > len(printed[s.rid]) and not text.endswith("\ufffd"):
            on_text(s.rid, text[len(printed[s.rid]):])
            printed[s.rid] = text

    counts = [0, 0]  # finished requests, generated tokens

    def on_token(s: Sequence) -> None:
        emit(s)
        if on_progress is not None:
            counts[0] += s.finish is not None
            counts[1] += s.finish != "eos"  # an EOS is not kept in the output
            on_progress(counts[0], counts[1])

    engine.on_token = on_token
    engine.run()
    summary = summarize(engine, built.info)
    if trace is not None:
        try:
            write_trace(engine, trace)
        except PagedWeightError as exc:  # the generations are still returned: the caller writes them, then reports
            summary["trace_error"] = str(exc)
    gens = []
    for rid, p in enumerate(prompts):
        s = engine.seqs[rid]
        gens.append(Generation(p, tokenizer.decode(s.out, skip_special_tokens=True), len(s.prompt), len(s.out),
                               s.finish or "length"))
    return gens, summary

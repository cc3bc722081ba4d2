"""Sample text from a checkpoint: a training (DCP) checkpoint or a Hugging Face folder.

    python scripts/generate.py outputs/laptop/pretrain/checkpoint/step-20 \\
        --prompt "Once upon a time"
    python scripts/generate.py ~/hf/Qwen3-0.6B --prompt "The capital of France is" \\
        --temperature 0.7 --top-p 0.9 --seed 1 --device cuda

CHECKPOINT  a DCP folder written by training (`<dump_folder>/checkpoint/step-N`; only the model
            entries are read, LoRA adapters are merged) or by convert_checkpoint.py --to dcp, or
            an HF folder (config.json + *.safetensors).
Model sizes: an HF folder's config.json; for DCP, --config, else what the checkpoint records of
            the run that made it (sizes, [lora], tokenizer path), else (a checkpoint recording
            none) the run's config.toml next to it (`<dump_folder>/config.toml`, which the
            latest launch wrote: a warning says so), else a config.json inside CHECKPOINT.
Tokenizer:  --tokenizer, else the run's model.tokenizer_path (from the same source), else the
            tokenizer files inside CHECKPOINT (an HF folder's tokenizer.json).
Decoding:   greedy by default; --temperature T > 0 samples, --top-p P keeps the smallest set of
            most likely tokens whose probability reaches P, --seed repeats a draw. Stops at the
            tokenizer's end-of-text token or after --max-new-tokens. The text goes to stdout,
            the speed to stderr.
Chat:       --chat renders --prompt as a user message (after --system, if given) with the chat
            template SFT trains with (the tokenizer folder's chat_template, else Qwen's chat
            format) and its generation prompt, stops at the end of the turn (<|im_end|>) and
            prints the reply only. Without --prompt on a terminal: one message per line, the
            history kept, until end of input (Ctrl-D).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("checkpoint", type=Path, help="DCP step-N folder or HF folder")
    p.add_argument("--prompt", help="the text to continue; with --chat, the user's message")
    p.add_argument("--chat", action="store_true", help="chat mode (see Chat above)")
    p.add_argument("--system", help="with --chat: a system message before the user's")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus size, in (0, 1]")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling draws")
    p.add_argument("--tokenizer", help="tokenizer path (as model.tokenizer_path)")
    p.add_argument("--config", type=Path, help="the run's config.toml (sizes of a DCP folder)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    a = p.parse_args(argv)
    if a.prompt is None and not (a.chat and sys.stdin.isatty()):
        p.error("--prompt is required (without it, --chat on a terminal chats interactively)")
    if a.system is not None and not a.chat:
        p.error("--system is a chat message: add --chat")
    if a.max_new_tokens < 1:
        p.error(f"--max-new-tokens {a.max_new_tokens}: at least 1")
    if not a.temperature >= 0:
        p.error(f"--temperature {a.temperature:g}: 0 (greedy) or more")
    if not 0 < a.top_p <= 1:
        p.error(f"--top-p {a.top_p:g}: in (0, 1]")
    return a


if __name__ == "__main__":  # --help and a wrong option answer before torch's imports (seconds)
    parse_args(sys.argv[1:])

import torch
from torch import nn

from torchtitan_ablate.components.checkpoint.hf import load_hf_weights
from torchtitan_ablate.components.checkpoint.offline_weights import (
    find_run_toml,
    read_dcp_model,
    recorded_args,
    recorded_settings,
)
from torchtitan_ablate.components.data.sft import ChatRenderer
from torchtitan_ablate.components.text.tokenizer import Tokenizer, build_tokenizer
from torchtitan_ablate.config import ConfigError, load_config
from torchtitan_ablate.models.common.lora import merge_lora_state_dict
from torchtitan_ablate.models.registry import (
    get_spec,
    hf_model_args,
    spec_for_args,
    state_dict_adapter,
)


def dcp_sizes(dcp_dir: Path, config: Path | None) -> tuple[Any, dict[str, Any] | None]:
    """Model sizes of a DCP checkpoint and the run's settings as "section.key" -> value (None
    when the sizes come from a config.json): --config, else the checkpoint's record, else the
    run's config.toml (a config takes the same path from [model] to sizes as training)."""
    record = None if config is not None else recorded_settings(dcp_dir)
    if record is not None:
        return recorded_args(record), record
    toml = config or find_run_toml(dcp_dir)
    if toml is not None:
        if config is None:
            print(
                f"generate: warning: {dcp_dir} records no model settings (a model-only "
                f"checkpoint, or an older version saved it): read from {toml}, which the run's "
                "latest launch wrote",
                file=sys.stderr,
            )
        job = load_config(["--job.config_file", str(toml)])
        spec = get_spec(job.model.name)
        args = spec.build_args(
            job.model, job.training.seq_len, job.checkpoint.initial_load_path, False
        )
        sections = dataclasses.asdict(job).items()
        return args, {f"{s}.{k}": v for s, body in sections for k, v in body.items()}
    if (dcp_dir / "config.json").is_file():
        return hf_model_args(dcp_dir), None
    raise ValueError(
        f"cannot tell the model sizes of {dcp_dir}: pass --config (the run's config.toml), or "
        "keep config.toml in the run's dump folder"
    )


def empty_model(args: Any, device: torch.device) -> nn.Module:
    """The model of its family on `device`, initialized (RoPE tables included) before its
    weights are read."""
    with torch.device("meta"):
        model = spec_for_args(args).model_cls(args)
    model.to_empty(device=device)
    model.init_weights(buffer_device=device)
    return model


def load_model(
    checkpoint: Path, config: Path | None, device: torch.device
) -> tuple[nn.Module, dict[str, Any] | None]:
    """The model of a DCP or HF folder (float32, eval mode) and the run's settings if known."""
    if not checkpoint.is_dir():
        raise ValueError(f"{checkpoint}: no such folder (give a checkpoint/step-N or HF folder)")
    if (checkpoint / ".metadata").is_file():
        args, settings = dcp_sizes(checkpoint, config)
        with warnings.catch_warnings():
            # One process by design (no_dist=True); DCP still warns about it on every call.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            state = read_dcp_model(checkpoint, args)
        if any(".lora_" in k for k in state):
            if settings is None or settings.get("lora.alpha") is None:
                raise ValueError(f"{checkpoint} holds LoRA adapters: pass --config for [lora]")
            state = merge_lora_state_dict(state, settings["lora.alpha"])
        for alias, source in state_dict_adapter(args).tied_keys().items():
            state[alias] = state[source]
        model = empty_model(args, device)
        model.load_state_dict(state)
    elif (checkpoint / "config.json").is_file():
        if config is not None:
            print("generate: warning: --config has no effect on an HF folder", file=sys.stderr)
        settings = None
        model = empty_model(hf_model_args(checkpoint), device)
        load_hf_weights(model.state_dict(), checkpoint)  # fills the parameters in place
    else:
        raise ValueError(
            f"{checkpoint} is neither a DCP checkpoint (no .metadata) nor an HF folder (no "
            "config.json)"
        )
    return model.eval(), settings


def load_tokenizer(
    path: str | None, checkpoint: Path, settings: dict[str, Any] | None
) -> Tokenizer:
    if path is None:
        path = settings["model.tokenizer_path"] if settings is not None else str(checkpoint)
    try:
        return build_tokenizer(path)
    except ConfigError as e:
        raise ValueError(f"tokenizer {path!r} (set it with --tokenizer): {e}") from None


def load(a: argparse.Namespace) -> tuple[nn.Module, Any, Tokenizer]:
    """The model (in --dtype), its family's spec and the tokenizer."""
    model, settings = load_model(a.checkpoint, a.config, torch.device(a.device))
    spec = spec_for_args(model.args)
    if spec.generate is None:
        raise ValueError(f"model family {spec.name!r} has no decoder (ModelSpec.generate)")
    model.to(getattr(torch, a.dtype))
    tokenizer = load_tokenizer(a.tokenizer, a.checkpoint, settings)
    if tokenizer.vocab_size > model.args.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens, the model {model.args.vocab_size}: "
            "pass the run's tokenizer with --tokenizer"
        )
    return model, spec, tokenizer


def new_tokens(
    model: nn.Module, spec: Any, a: argparse.Namespace, prompt_ids: list[int], stop_id: int
) -> list[int]:
    """The generated ids after prompt_ids, up to (not including) stop_id."""
    prompt_1L = torch.tensor([prompt_ids], device=a.device)
    start = time.perf_counter()
    new_1N = spec.generate(model, prompt_1L, a.max_new_tokens, a.temperature, a.top_p,
                           stop_id, a.seed)  # fmt: skip
    seconds = time.perf_counter() - start
    new_ids = new_1N[0].tolist()
    rate = new_1N.shape[1] / seconds
    print(f"{new_1N.shape[1]} tokens in {seconds:.2f} s ({rate:.1f} tokens/s)", file=sys.stderr)
    return new_ids[: new_ids.index(stop_id)] if stop_id in new_ids else new_ids


def typed_lines() -> Iterator[str]:
    """Lines typed at the terminal, until end of input."""
    while True:
        try:
            yield input("you> ")
        except EOFError:
            return


def run(a: argparse.Namespace) -> str:
    """Loads and generates: the prompt with its continuation; with --chat, the reply."""
    model, spec, tokenizer = load(a)
    if a.chat:
        render = ChatRenderer(tokenizer)  # a tokenizer without <|im_end|>: one line
        messages = [{"role": "system", "content": a.system}] if a.system else []
        if a.prompt is None:
            return converse(lambda m: reply(model, spec, a, render, m), messages, typed_lines())
        messages.append({"role": "user", "content": a.prompt})
        return reply(model, spec, a, render, messages)
    prompt_ids = tokenizer.encode(a.prompt)
    if not prompt_ids:
        raise ValueError("--prompt is empty: give some text to continue")
    # Decoded together: a BPE token may span the prompt's end.
    return tokenizer.decode(prompt_ids + new_tokens(model, spec, a, prompt_ids, tokenizer.eos_id))


def reply(
    model: nn.Module, spec: Any, a: argparse.Namespace, render: ChatRenderer, messages: list
) -> str:
    """The assistant's next message: generated after the chat template's generation prompt,
    stopped at the template's end of turn (<|im_end|>)."""
    ids = new_tokens(model, spec, a, render.generation_prompt(messages), render.im_end)
    return render.tokenizer.decode(ids)


def converse(answer: Callable[[list], str], messages: list, lines: Iterable[str]) -> str:
    """The interactive chat: each line read is a user message, each answer printed and kept in
    the history; ends at end of input. Returns the last answer."""
    text = ""
    print("chat: one message per line; Ctrl-D ends", file=sys.stderr)
    for line in lines:
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        text = answer(messages)
        messages.append({"role": "assistant", "content": text})
        print(text, flush=True)
    return text


def main(argv: list[str] | None = None) -> str:
    a = parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("generate: error: --device cuda: no CUDA device is available here", file=sys.stderr)
        raise SystemExit(2)
    try:
        text = run(a)
    except (ValueError, OSError) as e:  # unreadable or mismatching inputs (ConfigError too)
        print(f"generate: error: {str(e).splitlines()[0][:500]}", file=sys.stderr)
        raise SystemExit(2) from None
    if a.chat and a.prompt is None:
        return text  # printed turn by turn
    print(text)
    return text


if __name__ == "__main__":
    main()

"""A random-weight Llama target and EAGLE-3 drafter as Hugging Face folders (no download).

    python -m bench.random_model --out DIR [--shape 8b|tiny] [--layers N] [--hidden N]
        [--heads N] [--kv-heads N] [--intermediate N] [--vocab N] [--draft-vocab N]
        [--shards 5] [--device auto|cuda|cpu] [--seed 0]

writes ``DIR/target`` (config.json, ``--shards`` safetensors shards named as Hugging Face
names them, ``model.safetensors.index.json``, the byte tokenizer) and ``DIR/drafter``
(config.json, model.safetensors in the published EAGLE-3 layout: ``fc``, ``midlayer.*``,
``norm``, ``lm_head``, ``d2t`` offsets, ``t2d``). Shapes: ``bench.random_shapes``. Weights are
drawn on the GPU when there is one (``--device auto``), else on the CPU, and stored in bf16.

Scale, so that activations stay finite and O(1) in bf16 at any depth: norms 1; embedding
N(0, 1); a linear layer N(0, 1 / fan_in) (unit-RMS input -> unit-RMS output), except the
residual branches' outputs (``o_proj``, ``down_proj``), N(0, 1 / (fan_in * 2 * layers)), so all
layers together add about half the embedding's variance (the stream's RMS stays near 1, not
sqrt(layers): 1.08 after 28 of 32 layers in a 512-wide bf16 check); logits are about
N(0, 1). The 8B target is 16.06 GB (8.03 B parameters), its drafter 0.85 GB.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.random_shapes import PRESETS, Shape, drafter_config, shape_from, target_config
from models.byte_tokenizer import write_byte_tokenizer
from services.engine.models import Eagle3Drafter, EagleConfig, LlamaConfig, LlamaForCausalLM

INDEX = "model.safetensors.index.json"
RESIDUAL_OUTPUTS = ("o_proj.weight", "down_proj.weight")


def weight_std(name: str, shape: tuple[int, ...], layers: int) -> float:
    """The standard deviation of tensor ``name`` (see the module docstring); 0 = ones (a
    norm's weight)."""
    if len(shape) == 1:
        return 0.0
    if name.endswith("embed_tokens.weight"):
        return 1.0
    std = 1.0 / math.sqrt(shape[1])
    if name.endswith(RESIDUAL_OUTPUTS):
        std /= math.sqrt(2 * layers)
    return std


def shard_plan(sizes: list[int], shards: int) -> list[int]:
    """The shard of each tensor, in order: contiguous runs, none empty, a new shard begun
    once the bytes so far pass i / shards of the total. Needs len(sizes) >= shards."""
    if not 1 <= shards <= len(sizes):
        raise ValueError(f"shards: {shards} for {len(sizes)} tensors; must be 1..{len(sizes)}")
    total, done, current, plan = sum(sizes), 0, 0, []
    for i, size in enumerate(sizes):
        plan.append(current)
        done += size
        left = len(sizes) - i - 1  # tensors still to place; each later shard needs one
        if current < shards - 1 and (done >= total * (current + 1) / shards or left == shards - 1 - current):
            current += 1
    return plan


def shard_name(i: int, shards: int) -> str:
    return f"model-{i + 1:05d}-of-{shards:05d}.safetensors"


def random_tensor(name: str, shape: tuple[int, ...], layers: int, g: torch.Generator) -> torch.Tensor:
    """bf16 on the CPU, drawn on the generator's device; biases and attention sinks zero."""
    if name.endswith(("bias", "sinks")):
        return torch.zeros(shape, dtype=torch.bfloat16)
    std = weight_std(name, shape, layers)
    if std == 0.0:
        return torch.ones(shape, dtype=torch.bfloat16)
    drawn = torch.randn(shape, generator=g, device=g.device, dtype=torch.float32).mul_(std)
    return drawn.to(torch.bfloat16).cpu()


def write_target(folder: Path, shape: Shape, shards: int, g: torch.Generator) -> int:
    """config.json, the shards, their index and the tokenizer; returns the weights' bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    config = target_config(shape)
    with torch.device("meta"):
        names = {
            n: tuple(t.shape) for n, t in LlamaForCausalLM(LlamaConfig.from_dict(config)).state_dict().items()
        }
    sizes = [2 * math.prod(s) for s in names.values()]
    plan = shard_plan(sizes, shards)
    weight_map, pending = {}, {}
    for i, (name, s) in enumerate(names.items()):
        pending[name] = random_tensor(name, s, shape.layers, g)
        weight_map[name] = shard_name(plan[i], shards)
        if i == len(plan) - 1 or plan[i + 1] != plan[i]:
            save_file(pending, str(folder / weight_map[name]), metadata={"format": "pt"})
            pending = {}
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_byte_tokenizer(folder)
    return sum(sizes)


def write_drafter(folder: Path, shape: Shape, g: torch.Generator) -> int:
    """config.json and model.safetensors; ``d2t`` maps draft id i to target id i + d2t[i]
    (sorted random target ids), ``t2d`` marks those ids. Returns the bytes written."""
    folder.mkdir(parents=True, exist_ok=True)
    config = drafter_config(shape)
    with torch.device("meta"):
        model = Eagle3Drafter(EagleConfig.from_dict(config), own_head=True)
        names = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    state = {n: random_tensor(n, s, 1, g) for n, s in names.items() if n not in ("d2t", "t2d")}
    if "d2t" in names:
        picked = torch.randperm(shape.vocab, generator=torch.Generator().manual_seed(g.initial_seed()))
        targets = picked[: shape.draft_vocab].sort().values
        state["d2t"] = targets - torch.arange(shape.draft_vocab)
        state["t2d"] = torch.zeros(shape.vocab, dtype=torch.bool)
        state["t2d"][targets] = True
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return sum(t.numel() * t.element_size() for t in state.values())


def build(out: Path, shape: Shape, shards: int = 5, device: str = "auto", seed: int = 0) -> tuple[Path, Path]:
    """Write ``out/target`` and ``out/drafter``; returns their paths."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=device).manual_seed(seed)
    target_bytes = write_target(out / "target", shape, shards, g)
    drafter_bytes = write_drafter(out / "drafter", shape, g)
    print(
        f"random target {target_bytes / 1e9:.2f} GB in {shards} shards -> {out / 'target'}; "
        f"EAGLE-3 drafter {drafter_bytes / 1e9:.2f} GB -> {out / 'drafter'} (drawn on {device})"
    )
    return out / "target", out / "drafter"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for target/ and drafter/")
    p.add_argument("--shape", default="8b", choices=sorted(PRESETS))
    for field in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "draft_vocab"):
        p.add_argument(f"--{field.replace('_', '-')}", type=int, help=f"override the preset's {field}")
    p.add_argument("--shards", type=int, default=5, help="safetensors shards of the target")
    p.add_argument(
        "--device", default="auto", choices=("auto", "cuda", "cpu"), help="where weights are drawn"
    )
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    fields = ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "draft_vocab")
    shape = shape_from(a.shape, **{f: getattr(a, f) for f in fields})
    build(Path(a.out), shape, a.shards, a.device, a.seed)


if __name__ == "__main__":
    main()

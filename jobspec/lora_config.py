"""The ``lora`` recipe section (peft's names and defaults) and its checks; pure Python.

``train.method: lora`` trains low-rank adapters ``W + (alpha / r) * B @ A`` on the decoder's linear
layers (``target_modules``) with the base weights frozen; see finetune/model/lora.py.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from jobspec.recipe_parse import Problem

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SAVABLE = ("embed_tokens", "lm_head")  # modules_to_save: trained in full beside the adapters


@dataclass
class LoraConfig:
    """peft's LoraConfig fields, with its defaults (dropout 0.05 as most LoRA recipes)."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.05
    # layer names (every decoder layer's) or one regex fully matching a module path such as
    # model.layers.3.self_attn.q_proj, as peft takes target_modules
    target_modules: list[str] = field(default_factory=lambda: list(TARGETS))
    bias: str = "none"
    use_rslora: bool = False  # scale alpha / sqrt(r) instead of alpha / r
    init: str = "default"  # default: A Kaiming-uniform, B zero (step 0 is the base model) | gaussian: A ~ N(0, 1/r)
    modules_to_save: list[str] = field(default_factory=list)  # embed_tokens, lm_head: trained in full

    @property
    def scale(self) -> float:
        return self.alpha / (self.r ** 0.5 if self.use_rslora else self.r)

    def targets(self, module: str) -> bool:
        """Whether ``module`` (e.g. ``model.layers.0.self_attn.q_proj``) gets an adapter."""
        if len(self.target_modules) == 1 and self.target_modules[0] not in TARGETS:
            return re.fullmatch(self.target_modules[0], module) is not None
        return module.rsplit(".", 1)[-1] in self.target_modules


def module_path(layer: int, name: str) -> str:
    """The Hugging Face path of linear layer ``name`` (a ``TARGETS`` entry) of decoder layer ``layer``."""
    return f"model.layers.{layer}.{'mlp' if name in TARGETS[4:] else 'self_attn'}.{name}"


def lora_problems(c: LoraConfig) -> list[Problem]:
    """Every bad value of the ``lora`` section (``train.method``'s values are its Literal type)."""
    p: list[Problem] = []
    if c.r < 1:
        p.append(Problem("lora.r", "the adapter rank must be >= 1", "8", repr(c.r)))
    if not c.alpha > 0:
        p.append(Problem("lora.alpha", "must be > 0 (the adapter is scaled by alpha / r)", "16", repr(c.alpha)))
    if not 0 <= c.dropout < 1:
        p.append(Problem("lora.dropout", "a probability in [0, 1)", "0.05", repr(c.dropout)))
    if c.bias != "none":
        p.append(Problem("lora.bias", "only none is supported (biases stay frozen, as peft's default)", "none",
                         repr(c.bias)))
    if c.init not in ("default", "gaussian"):
        p.append(Problem("lora.init", "must be default or gaussian", "default", repr(c.init)))
    p += _target_problems(c)
    bad = [m for m in c.modules_to_save if m not in SAVABLE]
    if bad:
        p.append(Problem("lora.modules_to_save", f"{', '.join(bad)}: only {', '.join(SAVABLE)} can be trained in "
                         "full beside the adapters", "lm_head", repr(c.modules_to_save)))
    return p


def _target_problems(c: LoraConfig) -> list[Problem]:
    t = c.target_modules
    if not t:
        return [Problem("lora.target_modules", "no target: give layer names or a regex", ",".join(TARGETS), "[]")]
    if len(t) == 1 and t[0] not in TARGETS:
        try:
            re.compile(t[0])
        except re.error as e:
            return [Problem("lora.target_modules", f"neither a layer name ({', '.join(TARGETS)}) nor a valid "
                            f"regex: {e}", r"'model\.layers\.\d+\.self_attn\.(q|v)_proj'", repr(t[0]))]
        if not any(c.targets(module_path(0, n)) for n in TARGETS):
            return [Problem("lora.target_modules", "the regex matches no layer of layer 0 (module paths look like "
                            "model.layers.0.self_attn.q_proj)", r"'.*\.(q|v)_proj'", repr(t[0]))]
        return []
    bad = [m for m in t if m not in TARGETS]
    if bad:
        return [Problem("lora.target_modules", f"unknown layer(s) {', '.join(bad)}; names are {', '.join(TARGETS)} "
                        "(or one regex)", "q_proj,v_proj", repr(t))]
    return []


def trainable_elements(model_config: dict[str, Any], c: LoraConfig, tp: int = 1, vocab_parallel: bool = False
                       ) -> tuple[int, int]:
    """(adapter elements, modules_to_save elements) one TP rank holds: a column-parallel layer's B and a
    row-parallel layer's A are split like the layer (finetune/model/lora.py); the rest whole."""
    from jobspec.model_layout import local_shapes, param_table

    local = local_shapes(model_config, tp, vocab_parallel)
    adapters = 0
    for spec in param_table(model_config):
        module = spec.name.removesuffix(".weight")
        if spec.name.endswith(".weight") and module.rsplit(".", 1)[-1] in TARGETS and c.targets(module):
            (out, fan_in), (lout, lin) = spec.shape, local[spec.name]
            adapters += c.r * (fan_in + lout) if spec.tp_axis == 0 else c.r * (lin + out)
    saved = {"embed_tokens": "model.embed_tokens.weight",
             "lm_head": "lm_head.weight" if "lm_head.weight" in local else "model.embed_tokens.weight"}
    full = {saved[m] for m in c.modules_to_save}
    return adapters, sum(local[n][0] * local[n][1] for n in full)

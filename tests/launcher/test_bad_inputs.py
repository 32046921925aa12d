"""Bad inputs, one table: each refused before anything starts, in one line naming the value and the fix.

Every case runs ``python -m launcher train`` (in-process, a CPU host) with a stub as the job command and
asserts: the exit code (2: bad settings, 1: preflight failed), that the output names the key / variable /
file and the fix, that no traceback is printed, that the stub never ran, and that nothing in OUTPUT_DIR
changed.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import sys
from pathlib import Path

import pytest
from launcher_fakes import make_sys

import launcher.__main__ as lm
from jobspec.tiny import ensure_tiny_model


def _model(root: Path, name: str = "model") -> Path:
    """The tiny Qwen2 model with the real Qwen2.5 tokenizer; variants copy it (weights linked, unless changed)."""
    good = root / "model"
    ensure_tiny_model(good, {"num_hidden_layers": 1})
    if name == "model":
        return good
    d = root / name
    d.mkdir()
    for f in good.iterdir():
        if f.name == "model.safetensors":
            (d / f.name).symlink_to(f)
        else:
            shutil.copyfile(f, d / f.name)
    return d


def _unlinked(w: Path) -> bytes:
    data = w.read_bytes()
    w.unlink()
    return data


def _truncated(root: Path) -> Path:
    d = _model(root, "truncated")
    w = d / "model.safetensors"
    w.write_bytes(_unlinked(w)[:-100])  # a download cut short
    return d


def _malformed_config(root: Path) -> Path:
    d = _model(root, "malformed")
    (d / "config.json").write_text('{"hidden_size": 64,')
    return d


def _llama(root: Path) -> Path:
    d = _model(root, "llama")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    return d


def _no_tokenizer(root: Path) -> Path:
    d = _model(root, "notok")
    (d / "tokenizer.json").unlink()
    return d


def _garbage_weights(root: Path) -> Path:
    d = _model(root, "garbage")
    _unlinked(d / "model.safetensors")
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 10**9) + b"{")
    return d


def _other_tokenizer(root: Path) -> Path:
    d = _model(root, "othertok")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "vocab_size": 256}))  # a tokenizer of another model
    return d


def _one_json_object(root: Path) -> Path:
    f = root / "one.json"
    f.write_text('{\n  "instruction": "Say hi",\n  "output": "hi"\n}\n')
    return f


def _hostfile(root: Path) -> Path:
    f = root / "hosts.txt"
    f.write_text("10.0.0.11 slots=8\n10.0.0.12 slots=8\n")
    return f


def _text(name: str, text: str):
    """A fixture that writes one small input file."""
    return lambda root: (root / name).write_text(text)


def _a_file(root: Path) -> Path:
    f = root / "afile"
    f.write_text("x")
    return f


# (id, env (values may be callables of tmp_path), CLI items, exit code, strings the output must name)
CASES = [
    ("lr-inf", {}, ["train.lr=inf"], 2, ["train.lr='inf'", "finite", "e.g. train.lr=2e-5"]),
    ("lr-nan-overrides", {"OVERRIDES": "train.lr=nan"}, [], 2, ["OVERRIDES: train.lr='nan'", "e.g. train.lr="]),
    ("lr-zero", {}, ["train.lr=0"], 2, ["train.lr=0.0: must be > 0", "e.g. train.lr=2e-5"]),
    ("lr-negative", {}, ["train.lr=-1e-5"], 2, ["train.lr=-1e-05", "e.g. train.lr="]),
    ("eps-negative", {}, ["train.eps=-1e-8"], 2, ["train.eps=-1e-08: must be > 0", "e.g. train.eps=1e-6"]),
    ("weight-decay-negative", {}, ["train.weight_decay=-0.1"], 2,
     ["train.weight_decay=-0.1", "e.g. train.weight_decay=0"]),
    ("min-lr-negative", {}, ["train.min_lr=-1"], 2, ["train.min_lr=-1.0", "e.g. train.min_lr=0"]),
    ("clip-grad-negative", {}, ["train.clip_grad=-1"], 2, ["train.clip_grad=-1.0", "e.g. train.clip_grad=0"]),
    ("clip-grad-inf", {}, ["train.clip_grad=inf"], 2, ["train.clip_grad='inf'", "e.g. train.clip_grad="]),
    ("keep-checkpoints-negative", {}, ["train.keep_checkpoints=-1"], 2,
     ["train.keep_checkpoints=-1", "e.g. train.keep_checkpoints=0"]),
    ("loss-scale-zero", {}, ["train.loss_scale.initial=0"], 2,
     ["train.loss_scale.initial=0.0: must be > 0", "e.g. train.loss_scale.initial=65536"]),
    ("cluster-timeout-negative", {}, ["launch.cluster_time_out=-5"], 2,
     ["launch.cluster_time_out=-5", "e.g. launch.cluster_time_out=1"]),
    ("max-bad-steps-zero", {}, ["train.max_bad_steps=0"], 2, ["train.max_bad_steps=0", "e.g. train.max_bad_steps=1"]),
    ("max-steps-inf", {}, ["train.max_steps=inf"], 2, ["train.max_steps='inf'", "an integer", "e.g. train.max_steps="]),
    ("betas-one", {}, ["train.betas=0.9"], 2, ["train.betas=[0.9]", "e.g. train.betas=0.9,0.999"]),
    ("seq-len-tiny", {}, ["data.seq_len=4"], 2, ["data.seq_len=4: must be >= 8", "e.g. data.seq_len="]),
    ("bf16-on-cpu", {}, ["train.precision=bf16"], 2, ["train.precision='bf16'", "no bf16 matmul",
                                                       "e.g. train.precision=fp32"]),
    ("export-dtype", {}, ["export.dtype=int8"], 2, ["export.dtype='int8'", "e.g. export.dtype=bf16"]),
    ("shard-size", {}, ["export.shard_size=huge"], 2, ["export.shard_size='huge'", "e.g. export.shard_size=2GB"]),
    ("tp-not-a-number", {"TP": "two"}, [], 2, ["TP='two' (parallel.tp): expected an integer or auto", "e.g. TP=auto"]),
    ("tp-does-not-divide", {"TP": "3", "NPROC_PER_NODE": "4"}, [], 2, ["TP='3' (parallel.tp)", "e.g. TP=2"]),
    ("dp-mismatch", {"DP": "3", "NPROC_PER_NODE": "2"}, [], 2, ["DP='3' (parallel.dp)", "e.g. DP=2"]),
    ("pp", {"PP": "2", "NPROC_PER_NODE": "2"}, [], 2, ["PP='2' (parallel.pp)", "e.g. PP=1"]),
    ("nproc-negative", {"NPROC_PER_NODE": "-1"}, [], 2, ["NPROC_PER_NODE='-1' (launch.nproc_per_node)",
                                                         "e.g. NPROC_PER_NODE=0"]),
    ("nproc-text", {"NPROC_PER_NODE": "all"}, [], 2, ["NPROC_PER_NODE='all'", "e.g. NPROC_PER_NODE="]),
    ("nnodes-zero", {"NNODES": "0"}, [], 2, ["NNODES='0' (launch.nnodes)", "e.g. NNODES=1"]),
    ("two-nodes-no-master", {"NNODES": "2"}, [], 2, ["launch.nnodes=2 but no MASTER_ADDR", "e.g. MASTER_ADDR="]),
    ("node-rank-shell", {"NODE_RANK": "$(touch {tmp}/pwned)"}, [], 2, ["NODE_RANK='$(touch", "e.g. NODE_RANK="]),
    ("node-rank-too-big", {"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "10.0.0.1"}, [], 2,
     ["NODE_RANK='2' (launch.node_rank): must be < launch.nnodes=2", "e.g. NODE_RANK=0"]),
    ("master-port-range", {"MASTER_PORT": "99999"}, [], 2, ["MASTER_PORT='99999'", "e.g. MASTER_PORT=8118"]),
    ("master-port-text", {"MASTER_PORT": "abc"}, [], 2, ["MASTER_PORT='abc'", "e.g. MASTER_PORT=8118)"]),
    ("nproc-zero", {"NPROC_PER_NODE": "0"}, [], 2, ["NPROC_PER_NODE=0: no workers", "leave it unset",
                                                    "e.g. NPROC_PER_NODE=8"]),
    ("nproc-zero-overrides", {"OVERRIDES": "launch.nproc_per_node=0"}, [], 2,
     ["OVERRIDES: launch.nproc_per_node=0: no workers"]),
    ("overrides-unclosed-quote", {"OVERRIDES": 'data.system_prompt="You are'}, [], 2,
     ["OVERRIDES='data.system_prompt=\"You are'", "the quote after data.system_prompt= is not closed",
      "OVERRIDES='data.system_prompt=\"You are a pirate\" train.lr=1e-5'"]),
    ("recipe-a-directory", {"RECIPE": "{tmp}"}, [], 2, ["a directory, not a recipe; give a YAML file"]),
    ("hostfile-host-twice", {"HOSTFILE": "{tmp}/twice.txt", "NODE_RANK": "0"}, [], 2,
     ["twice.txt: host 10.0.0.11 is listed twice (line 1 and line 4)", "list each node once"]),
    ("max-restarts-negative", {"MAX_RESTARTS": "-1"}, [], 2, ["MAX_RESTARTS='-1'", "e.g. MAX_RESTARTS=0"]),
    ("overrides-dot", {"OVERRIDES": ".=2"}, [], 2, ["OVERRIDES: override '.=2'", "e.g. train.lr=1e-5"]),
    ("overrides-no-equals", {"OVERRIDES": "oops"}, [], 2, ["OVERRIDES: override 'oops'", "e.g. train.lr=1e-5"]),
    ("overrides-typo", {"OVERRIDES": "train.lrr=1"}, [], 2, ["OVERRIDES: train.lrr: unknown key",
                                                             "did you mean train.lr?"]),
    ("cli-garbled", {}, ["=1"], 2, ["override '=1'", "e.g. train.lr=1e-5"]),
    ("data-format", {"DATA_FORMAT": "csv"}, [], 2, ["DATA_FORMAT='csv' (data.format)", "e.g. DATA_FORMAT=auto"]),
    ("numa-bind", {"NUMA_BIND": "sometimes"}, [], 2, ["NUMA_BIND='sometimes'", "e.g. NUMA_BIND=auto"]),
    ("dry-run", {"DRY_RUN": "maybe"}, [], 2, ["DRY_RUN='maybe'", "e.g. DRY_RUN=true"]),
    ("recipe-unknown", {"RECIPE": "nope"}, [], 2, ["RECIPE='nope'", "tiny-cpu"]),
    ("recipe-on-cli-unknown", {}, ["RECIPE=nope"], 2, ["RECIPE='nope'", "tiny-cpu"]),
    ("output-is-a-file", {"OUTPUT_DIR": "{tmp}/afile"}, [], 2, ["OUTPUT_DIR='", "(output_dir): is a file",
                                                                "e.g. OUTPUT_DIR=/data/output/run1"]),
    ("output-under-a-file", {"OUTPUT_DIR": "{tmp}/afile/out"}, [], 2,
     ["(output_dir): is inside", "which is a file", "e.g. OUTPUT_DIR="]),
    ("hostfile-missing", {"HOSTFILE": "{tmp}/nope.txt"}, [], 2, ["HOSTFILE=", "no such file", "hostfiles/"]),
    ("hostfile-node-rank-out-of-range", {"HOSTFILE": "{tmp}/hosts.txt", "NODE_RANK": "5"}, [], 2,
     ["NODE_RANK=5", "lists 2 node(s)", "use 0..1"]),
    ("resume-missing", {"MODEL_DIR": "{tmp}/model"}, ["train.resume={tmp}/nope"], 1,
     ["train.resume=", "no checkpoint there", "train.resume=auto"]),
    ("model-dir-typo", {"MODEL_DIR": "{tmp}/modle"}, [], 1, ["MODEL_DIR=", "modle: no such directory",
                                                            "set MODEL_DIR to a Hugging Face model directory"]),
    ("model-truncated", {"MODEL_DIR": "{tmp}/truncated"}, [], 1, ["truncated/model.safetensors: truncated",
                                                                 "re-download"]),
    ("model-garbage-weights", {"MODEL_DIR": "{tmp}/garbage"}, [], 1,
     ["garbage/model.safetensors: not a readable safetensors file", "re-download"]),
    ("model-config-malformed", {"MODEL_DIR": "{tmp}/malformed"}, [], 1, ["malformed/config.json: malformed",
                                                                        "re-download"]),
    ("model-llama", {"MODEL_DIR": "{tmp}/llama"}, [], 1, ["model_type 'llama' (LlamaForCausalLM) is not supported",
                                                          "Qwen3ForCausalLM", "Qwen2.5 or Qwen3 dense model"]),
    ("model-no-tokenizer", {"MODEL_DIR": "{tmp}/notok"}, [], 1, ["missing tokenizer.json", "MODEL_DIR must be"]),
    ("model-other-tokenizer", {"MODEL_DIR": "{tmp}/othertok"}, [], 1,
     ["othertok/tokenizer.json: has token ids up to 151664, config.json's vocab_size is 256",
      "use the tokenizer that came with the model"]),
    ("data-missing", {"DATA": "{tmp}/nope.jsonl"}, [], 1, ["not found:", "nope.jsonl", "fix DATA"]),
    ("data-one-json-object", {"DATA": "{tmp}/one.json"}, [], 1, ["one.json: one JSON object over several lines",
                                                                 "a .json file holds an array"]),
    ("data-json-syntax", {"DATA": "{tmp}/object.json"}, [], 1,
     ["object.json: line 4 (column 1): not valid JSON", "a .json file holds an array"]),
]

FIXTURES = (_model, _other_tokenizer, _truncated, _malformed_config, _llama, _no_tokenizer, _garbage_weights,
            _one_json_object, _hostfile, _a_file,
            _text("twice.txt", "10.0.0.11 slots=8\n10.0.0.12 slots=8\n# node c\n10.0.0.11 slots=8\n"),
            _text("object.json", '{\n  "instruction": "Say hi",\n  "output": "hi",\n}\n'))  # a trailing comma


@pytest.fixture(scope="module")
def inputs(module_tmp) -> Path:
    root = module_tmp
    for make in FIXTURES:
        make(root)
    return root


def _tree(d: Path) -> dict[str, tuple[int, int]]:
    """Every entry with size and mtime (a refused run creates not even the job lock)."""
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(d.rglob("*"))}


@pytest.mark.parametrize("name,env,cli,rc,names", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_before_anything_starts(name, env, cli, rc, names, inputs, tmp_path, capsys):
    out_dir = tmp_path / "out"
    (out_dir / "checkpoints").mkdir(parents=True)
    (out_dir / "metrics.jsonl").write_text('{"step": 1}\n')  # an earlier run's output, to be left alone
    before = _tree(out_dir)
    started = tmp_path / "started"
    fill = {"tmp": str(inputs)}
    env = {"OUTPUT_DIR": str(out_dir), "PATH": os.environ["PATH"],
           **{k: v.format(**fill) for k, v in env.items()}}
    (tmp_path / "dev").mkdir()
    host = lm.Host(env=env, dev_dir=tmp_path / "dev", root=tmp_path, npu_smi=None, identities={"10.0.0.99"},
                   sys_root=make_sys(tmp_path, {0: "0-1"}, cpuset_v2="0-1"), cwd=tmp_path,
                   command=[sys.executable, "-c", f"open({str(started)!r}, 'w')"])
    code = lm.main(["train", *[c.format(**fill) for c in cli]], host)
    out = capsys.readouterr()
    text = out.out + out.err
    assert code == rc, text
    for s in names:
        assert s in text, f"{s!r} not in:\n{text}"
    assert "Traceback" not in text and "check crashed" not in text
    assert not started.exists() and not (inputs / "pwned").exists()
    assert _tree(out_dir) == before, "OUTPUT_DIR changed"


def test_there_are_at_least_40_cases():
    assert len(CASES) >= 40


def test_an_unwritable_output_dir_is_refused(tmp_path, capsys):
    target = Path("/proc/sys/ascend-finetune-out")  # read-only even for root
    if os.access(target.parent, os.W_OK):
        pytest.skip("/proc/sys is writable here")
    (tmp_path / "dev").mkdir()
    host = lm.Host(env={"OUTPUT_DIR": str(target)}, dev_dir=tmp_path / "dev", root=tmp_path, npu_smi=None,
                   sys_root=make_sys(tmp_path, {0: "0-1"}, cpuset_v2="0-1"))
    assert lm.main(["plan"], host) == 2
    assert "(output_dir): /proc/sys is not writable by this user" in capsys.readouterr().err


def test_an_unexpected_error_is_one_line_with_the_traceback_in_a_file(monkeypatch, capsys):
    def boom():
        raise RuntimeError("disk on fire")
    monkeypatch.setattr(lm, "main", boom)
    assert lm.console_main() == 1
    err = capsys.readouterr().err
    assert err.startswith("[launcher] error: RuntimeError: disk on fire (full traceback in ") and "Traceback" not in err
    log = Path(err.split("full traceback in ")[1].rstrip(")\n"))
    assert "Traceback" in log.read_text() and "disk on fire" in log.read_text()
    log.unlink()

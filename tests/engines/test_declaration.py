"""What an engine started from the base checkpoint keeps: the declaration the trainer writes
(``declare_kept``), read back as the engine reads it, and how an engine resolves what is kept
(its configuration, ``FSDP_PRECISION_KEPT``, the model directory's export record, a Hub id's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fsdp_precision import EngineDtypeError, full_weights
from fsdp_precision._engines.declaration import read_declaration, resolve_kept
from fsdp_precision._engines.kept import kept_of_stream
from fsdp_precision.checkpoint import CheckpointReadError, export_safetensors
from fsdp_precision.integrations import KEPT_ENV, declare_kept

from tests.edges.test_export import GATES, mixed_qwen

pytestmark = pytest.mark.fast
bf16, fp32 = torch.bfloat16, torch.float32


@pytest.fixture(scope="module")
def declared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return declare_kept(mixed_qwen(), tmp_path_factory.mktemp("declared") / "kept.json")


def test_a_declaration_holds_what_the_stream_keeps_and_no_weights(declared: Path) -> None:
    kept = read_declaration(declared)
    stream = kept_of_stream(full_weights(mixed_qwen()))
    assert dict(kept.tensors) == dict(stream.tensors) == dict.fromkeys(GATES, fp32)
    assert kept.bulk == bf16 and kept.source == str(declared)
    document = json.loads(declared.read_text())
    assert document["format"] == "fsdp_precision.kept" and "weights" not in document
    assert declared.stat().st_size < 2000  # names and dtypes, no tensor
    inline = read_declaration(document)  # a launcher may inline it in the engine's config
    assert dict(inline.tensors) == dict(kept.tensors)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory without any record: the base checkpoint an RL run starts the engine from."""
    out = tmp_path_factory.mktemp("base")
    (out / "config.json").write_text("{}")
    return out


def test_an_engine_learns_what_is_kept_from_its_config_or_the_environment(
    base: Path, declared: Path
) -> None:
    assert resolve_kept(str(base), environ={}) is None  # nothing said: the engine as always
    by_config = resolve_kept(str(base), declared=str(declared), environ={})
    by_env = resolve_kept(str(base), environ={KEPT_ENV: str(declared)})
    assert by_config is not None and by_env is not None
    assert dict(by_config.tensors) == dict(by_env.tensors) == dict.fromkeys(GATES, fp32)


def test_an_export_engages_on_its_own_and_a_declaration_must_agree(
    declared: Path, tmp_path: Path
) -> None:
    export = tmp_path / "export"
    export_safetensors(mixed_qwen(), export, dtype=bf16)
    alone = resolve_kept(str(export), environ={})
    assert alone is not None and dict(alone.tensors) == dict.fromkeys(GATES, fp32)
    assert resolve_kept(str(export), declared=str(declared), environ={}) is not None  # agree
    other = json.loads(declared.read_text())
    other["kept"].pop(GATES[0])
    with pytest.raises(EngineDtypeError, match=rf"keeps other tensors .*{GATES[0]} float32"):
        resolve_kept(str(export), declared=other, environ={})


def test_a_hub_id_resolves_the_record_in_the_hubs_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``LLM(model="org/name")``: vLLM keeps the id; the record is found in the Hub's cache
    (offline here) as vLLM finds the weights. Negative control: an id without one."""
    hub = pytest.importorskip("huggingface_hub")
    from huggingface_hub import constants

    export = tmp_path / "export"
    export_safetensors(mixed_qwen(), export, dtype=bf16)
    cache = tmp_path / "hub"
    snapshot = cache / "models--org--kept-moe" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "fsdp_precision_export.json").write_text(
        (export / "fsdp_precision_export.json").read_text()
    )
    (cache / "models--org--kept-moe" / "refs").mkdir()
    (cache / "models--org--kept-moe" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert hub.try_to_load_from_cache("org/kept-moe", "config.json") is None
    kept = resolve_kept("org/kept-moe", environ={})
    assert kept is not None and dict(kept.tensors) == dict.fromkeys(GATES, fp32)
    assert resolve_kept("org/stock-moe", environ={}) is None


@pytest.mark.parametrize(
    ("declared", "error", "match"),
    [
        (42, EngineDtypeError, r"configuration is 42; pass the path of a file declare_kept"),
        ("missing.json", CheckpointReadError, r"cannot read the declaration .*missing.json"),
        ({"format": "other"}, CheckpointReadError, r"its format is not 'fsdp_precision.kept'"),
        (
            {"format": "fsdp_precision.kept", "format_version": 1, "layout": "plain"},
            CheckpointReadError,
            r"its layout is 'plain'",
        ),
    ],
    ids=["not a path", "missing", "foreign", "plain layout"],
)
def test_a_declaration_engines_cannot_use_is_refused_by_name(
    base: Path, declared: object, error: type[Exception], match: str, tmp_path: Path
) -> None:
    if declared == "missing.json":
        declared = str(tmp_path / "missing.json")
    with pytest.raises(error, match=match):
        resolve_kept(str(base), declared=declared, environ={})


def test_the_digest_that_keys_engine_caches_changes_with_what_is_kept(declared: Path) -> None:
    document = json.loads(declared.read_text())
    same = read_declaration(dict(document))
    assert same.digest() == read_declaration(declared).digest()
    document["kept"] = {**document["kept"], GATES[0]: {"dtype": "float64", "reason": "r"}}
    assert read_declaration(document).digest() != same.digest()


def test_loading_the_vllm_plugin_imports_only_what_it_uses() -> None:
    """vLLM runs the plugin's entry point in every process it starts: importing it (and
    resolving what an engine is told is kept) imports none of the trainer's layers (planning,
    training, the torch patch, the advisor, weight streams). Negative control: a public name
    of the package, resolved, imports them (the package's names load on first use)."""
    import subprocess
    import sys

    def imported(code: str) -> set[str]:
        script = (
            f"import json, sys; {code}; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('fsdp_precision'))))"
        )
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        return set(json.loads(out.stdout.strip().splitlines()[-1]))

    heavy = ("_plan", "_train", "_patch", "_advise", "_edges.stream")
    plugin = imported(
        "import fsdp_precision._engines.vllm.plugin; "
        "from fsdp_precision._engines.declaration import resolve_kept; resolve_kept('.')"
    )
    assert not {m for m in plugin for h in heavy if f"fsdp_precision.{h}" in m}, sorted(plugin)
    trainer = imported(
        "import fsdp_precision as f; f.compile_param_dtype_maps, f.wrap_model_for_training"
    )
    assert {h for h in heavy[:3] if any(f"fsdp_precision.{h}" in m for m in trainer)} == set(
        heavy[:3]
    )

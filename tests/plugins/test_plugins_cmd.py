"""`runtime plugins`, called directly."""
import argparse
import json

import pytest

from runtime.cli.plugins_cmd import OP_NAMES, add_plugins_parser, plugins_command


def _args(*argv):
    parser = argparse.ArgumentParser(prog="runtime")
    add_plugins_parser(parser.add_subparsers())
    return parser.parse_args(["plugins", *argv])


def test_text_report(capsys):
    args = _args()
    assert args.func is plugins_command
    assert plugins_command(args) == 0
    out = capsys.readouterr().out
    assert "Plugins:" in out and "runtime.platforms.cpu" in out
    assert "ACTIVE: highest priority (0) among usable candidates" in out
    assert "Active platform: cpu" in out
    for fact in ("features:", "default dtype:", "attention backend:", "graph runner:      eager"):
        assert fact in out


def test_json_report(capsys):
    assert plugins_command(_args("--json")) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["plugins"][0] == {"name": "cpu", "source": "builtin", "loaded": True,
                                    "reason": "", "target": "runtime.platforms.cpu"}
    assert report["active"]["name"] == "cpu" and report["error"] is None
    assert report["active"]["facts"]["default dtype"] in ("float32", "bfloat16")
    who = {(a["hook"], a["op"]): a["answered_by"] for a in report["active"]["answers"]}
    assert who[("runtime_graph_runner", "")] == "cpu platform"
    assert who[("runtime_attention_backend", "")] == "cpu platform"
    assert who[("runtime_custom_op", "linear")] == "cpu platform"
    assert set(who) >= {("runtime_custom_op", op) for op in ("rms_norm", "add_rms_norm")}


def test_unknown_device_reports_the_error(capsys):
    assert plugins_command(_args("--device", "nosuch")) == 1
    out = capsys.readouterr().out
    assert "No active platform:" in out and "no platform named 'nosuch'" in out
    assert "not the forced one (--device nosuch)" in out


@pytest.mark.usefixtures("fake_plugin")
def test_report_with_a_third_party_plugin(capsys):
    assert plugins_command(_args("--json")) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["active"]["name"] == "fakedev"
    assert report["active"]["facts"] == {"device": "fake accelerator (runs on the host)"}
    assert {p["name"]: p["loaded"] for p in report["plugins"]}["fake_broken"] is False
    assert [(p["name"], p["active"]) for p in report["platforms"] if p["detected"]] == [
        ("fakedev", True), ("cpu", False)]


def test_every_hook_says_who_answered(capsys):
    from runtime.plugins import hookspecs
    assert plugins_command(_args("--json")) == 0
    answers = json.loads(capsys.readouterr().out)["active"]["answers"]
    specs = {name for name in vars(hookspecs) if name.startswith("runtime_")}
    assert {a["hook"] for a in answers} == specs
    who = {a["hook"]: a["answered_by"] for a in answers}
    assert who["runtime_detect_platforms"] == "cpu"
    assert who["runtime_communicator"] == "cpu platform"  # who implements it: one rank asks none
    assert who["runtime_register_models"] is None and who["runtime_logits_processors"] is None
    assert who["runtime_register_kv_connectors"] is None


def test_every_named_op_is_reported(capsys):
    """Each op name the layers ask `runtime_custom_op` for, and only those, is in OP_NAMES and
    the hook's contract, and the report has a row for each (the CPU kernels answer the
    recurrent layers' ops, the fused experts stay portable)."""
    import re
    from pathlib import Path

    from runtime.plugins import hookspecs
    root = Path(__file__).parents[2] / "runtime"
    asked = {m for path in root.rglob("*.py")
             for m in re.findall(r'custom_op\("(\w+)"\)', path.read_text(encoding="utf-8"))}
    assert asked == set(OP_NAMES)
    contract = hookspecs.runtime_custom_op.__doc__
    assert [n for n in OP_NAMES if f'"{n}"' not in contract] == []
    assert plugins_command(_args("--json")) == 0
    rows = [a for a in json.loads(capsys.readouterr().out)["active"]["answers"]
            if a["hook"] == "runtime_custom_op"]
    assert [r["op"] for r in rows] == list(OP_NAMES)
    who = {r["op"]: r["answered_by"] for r in rows}
    assert who["mamba2_chunk_scan"] == who["gated_rms_norm"] == "cpu platform"
    assert who["fused_moe"] is None

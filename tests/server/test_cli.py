"""`runtime serve` options: defaults, --config files, and flags winning over files."""
from __future__ import annotations

import pytest

from runtime.cli.main import build_parser
from runtime.cli.serve import resolve_options


def parse(*argv: str):
    return resolve_options(build_parser().parse_args(["serve", *argv]))


def test_defaults():
    args = parse()
    assert (args.host, args.port, args.model_tag, args.api_key) == ("127.0.0.1", 8000, None, None)
    assert args.max_num_seqs == 256 and args.enable_prefix_caching is True


def test_config_file_fills_what_the_flags_leave(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("max-num-seqs: 8\nenable_prefix_caching: false\nport: 9000\n"
                    "served_model_name: from-file\n")
    args = parse("my-model", "--config", str(path), "--port", "9100")
    assert args.max_num_seqs == 8 and args.enable_prefix_caching is False
    assert args.port == 9100  # the flag wins
    assert args.served_model_name == ["from-file"] and args.model_tag == "my-model"


def test_config_file_rejects_unknown_options(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("max_num_sequences: 8\n")
    with pytest.raises(ValueError, match="max_num_sequences"):
        parse("--config", str(path))

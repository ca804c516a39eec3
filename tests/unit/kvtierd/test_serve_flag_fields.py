"""``kvtierd serve``: every flag (but ``--config``) reaches the DaemonConfig field of its
``dest``, and one not given leaves the file's value (kvtierd.cli._config)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtierd.cli import _config, build_parser
from kvtierd.config import flat_keys


def test_every_serve_flag_is_handed_to_the_config() -> None:
    """Each flag's ``dest`` is the field it sets: _config hands every one to the config."""
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr,index]
    dests = [a.dest for a in serve._actions if a.option_strings and a.dest not in ("help", "config")]
    assert set(dests) <= set(flat_keys()) and len(set(dests)) == len(dests)  # each once
    args = build_parser().parse_args(["serve", "--lease-ttl-s", "7", "--host-bytes", "2GiB"])
    assert set(vars(args)) - set(dests) == {"command", "config"}  # nothing else to hand over


def test_a_flag_given_overrides_the_file_and_one_not_given_does_not(tmp_path: Path) -> None:
    path = tmp_path / "k.toml"
    path.write_text('listen = "127.0.0.1:7001"\nlease_ttl_s = 9.0\n')
    args = build_parser().parse_args(["serve", "--config", str(path), "--lease-ttl-s", "7"])
    cfg = _config(args)
    assert cfg.grpc.listen == "127.0.0.1:7001"  # the file's
    assert cfg.sessions.lease_ttl_s == 7.0  # the flag's


def test_a_flag_is_spelt_whole(capsys: pytest.CaptureFixture[str]) -> None:
    """A prefix is no flag: a deployment that sets --listen itself (the chart) and refuses it
    in its extra arguments cannot be passed ``--liste 0.0.0.0:50051``."""
    for argv in (
        ["serve", "--liste", "0.0.0.0:50051"],
        ["serve", "--allow-plaintext-r"],
        ["fsck", "--max-p", "3", "d"],
    ):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(argv)
        assert e.value.code == 2
        assert f"unrecognized arguments: {argv[1]}" in capsys.readouterr().err

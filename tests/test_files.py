"""memfit.files.write_text_atomic: whole or nothing, the usual file mode, never onto a device (issue 22: plan.yaml
was written 0600; issue 27: ``plan -o /dev/null`` replaced the device with a regular file)."""

from __future__ import annotations

import os
import stat

import pytest

from memfit.errors import UserError
from memfit.files import write_text_atomic


def test_new_file_gets_0666_minus_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        write_text_atomic(tmp_path / "plan.yaml", "a: 1\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "plan.yaml").stat().st_mode) == 0o640  # 0o666 & ~0o027
    assert (tmp_path / "plan.yaml").read_text() == "a: 1\n"
    assert [p.name for p in tmp_path.iterdir()] == ["plan.yaml"]  # no temporary file left


def test_an_existing_file_keeps_its_mode(tmp_path):
    target = tmp_path / "plan.yaml"
    target.write_text("old")
    target.chmod(0o604)
    write_text_atomic(target, "new")
    assert target.read_text() == "new" and stat.S_IMODE(target.stat().st_mode) == 0o604


def test_a_symlink_is_replaced_not_written_through(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    link = tmp_path / "plan.yaml"
    link.symlink_to(victim)
    write_text_atomic(link, "plan")
    assert victim.read_text() == "keep me"
    assert not link.is_symlink() and link.read_text() == "plan"


def test_a_special_file_is_refused_and_left_alone(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(UserError, match="not a regular file"):
        write_text_atomic(fifo, "x", what="--output")
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    with pytest.raises(UserError, match="not a regular file"):
        write_text_atomic("/dev/null", "x", what="--output")
    assert stat.S_ISCHR(os.lstat("/dev/null").st_mode)


def test_a_folder_is_refused(tmp_path):
    with pytest.raises(UserError, match="is a folder"):
        write_text_atomic(tmp_path, "x")


def test_plan_output_is_written_with_the_usual_mode(tmp_path):
    from click.testing import CliRunner

    from memfit.cli import cli

    old = os.umask(0o022)
    try:
        result = CliRunner().invoke(cli, ["plan", "tiny", "--budget", "1GiB", "--seq-len", "64", "--batch", "4",
                                          "--output", str(tmp_path / "plan.yaml")])
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE((tmp_path / "plan.yaml").stat().st_mode) == 0o644
    result = CliRunner().invoke(cli, ["plan", "tiny", "--budget", "1GiB", "--seq-len", "64", "--batch", "4",
                                      "--output", "/dev/null"])
    assert result.exit_code == 1 and "not a regular file" in result.output

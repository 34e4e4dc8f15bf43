"""Mistakes a user makes on the command line end in one line naming the flag, never in a traceback: an output
folder that cannot be created, a gallery case that does not exist, and a Ctrl-C while a comparison's cells run
in worker processes (the workers end quietly; the parent says once that the run can be resumed)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from sim.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _one_line_error(capsys, argv, flag="--out"):
    status = main(argv)
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "error:" in lines[0] and flag in lines[0], err
    return lines[0]


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("not a folder\n")
    return path


@pytest.mark.parametrize("command", [
    ["central", "--method", "nonprivate", "--preset", "tiny"],
    ["compare", "--preset", "tiny", "--methods", "public-only", "--epsilons", "1"],
    ["simulate", "--method", "pate-ae", "--preset", "tiny"],
    ["demo", "--preset", "tiny"],
    ["data", "phantoms", "--cases", "2"],
])
def test_an_out_under_a_regular_file_is_refused_in_one_line(capsys, a_file, command):
    line = _one_line_error(capsys, command + ["--out", str(a_file / "run")])
    assert str(a_file) in line


def test_predict_refuses_an_out_it_cannot_create(capsys, a_file, monkeypatch):
    import task.reporting.bundle

    card = {"private": False, "method": "public-only"}   # the bundle's own checks are tested in test_bundle.py
    monkeypatch.setattr(task.reporting.bundle, "load_bundle", lambda model: SimpleNamespace(card=card))
    _one_line_error(capsys, ["predict", "--model", "m", "--image", "x.nii.gz", "--out", str(a_file / "maps")])


def test_an_out_that_is_a_file_is_refused_by_a_folder_command(capsys, a_file):
    line = _one_line_error(capsys, ["data", "phantoms", "--cases", "2", "--out", str(a_file)])
    assert "not a folder" in line


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root may write into any folder")
def test_an_out_in_a_read_only_folder_is_refused(capsys, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        _one_line_error(capsys, ["data", "phantoms", "--cases", "2", "--out", str(locked / "run")])
    finally:
        locked.chmod(0o755)


def test_gallery_names_a_case_that_does_not_exist(capsys, tiny_phantoms, tmp_path):
    line = _one_line_error(capsys, ["data", "gallery", str(tiny_phantoms), "--case", "NOPE",
                                    "--out", str(tmp_path / "g.png")], flag="--case NOPE")
    assert "48 cases: BRATS_" in line
    assert not (tmp_path / "g.png").exists()


def test_gallery_refuses_an_out_inside_a_file_or_a_folder(capsys, tiny_phantoms, a_file, tmp_path):
    _one_line_error(capsys, ["data", "gallery", str(tiny_phantoms), "--out", str(a_file / "g.png")])
    line = _one_line_error(capsys, ["data", "gallery", str(tiny_phantoms), "--out", str(tmp_path)])
    assert "is a folder" in line


@pytest.mark.slow
@pytest.mark.skipif(os.name != "posix", reason="process groups and SIGINT")
def test_ctrl_c_during_a_two_worker_compare_prints_one_line_and_no_traceback(tmp_path, tiny_phantoms):
    """A terminal's Ctrl-C is SIGINT to the whole foreground process group: the parent and both workers."""
    (tmp_path / "cache" / "phantoms").mkdir(parents=True)   # the session's tiny population, linked
    (tmp_path / "cache" / "phantoms" / tiny_phantoms.name).symlink_to(tiny_phantoms)
    env = {**os.environ, "FEDPATE_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "sim.cli", "compare", "--preset", "tiny", "--methods",
               "nonprivate-central,public-only", "--epsilons", "1", "--workers", "2", "--no-progress",
               "--out", str(tmp_path / "run")]
    # restore_signals resets only SIGPIPE and SIGXFSZ: a SIGINT that pytest-xdist's worker ignores would stay
    # ignored in the command, so it starts with the default action, as under a terminal
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        lines = []
        for line in process.stdout:   # the workers start right after this line
            lines.append(line)
            if "workers x" in line:
                break
        else:
            pytest.fail(f"no workers started: {''.join(lines)} {process.stderr.read()}")
        time.sleep(4.0)   # the workers are importing torch or running their first cell
        os.killpg(process.pid, signal.SIGINT)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    interrupted = [line for line in err.splitlines() if "interrupted" in line]
    assert len(interrupted) == 1 and "run the same command again to resume" in interrupted[0], err


def test_an_error_of_the_machine_is_one_line_too(capsys, monkeypatch):
    """A full disk or a file removed under a running command is the machine's problem, not a bug: one line
    naming the file, exit status 1."""
    import errno

    import sim.commands.data

    def full_disk(args):
        raise OSError(errno.ENOSPC, "No space left on device", "/runs/x/report.md")

    monkeypatch.setattr(sim.commands.data, "_inspect", full_disk)
    assert main(["data", "inspect", "somewhere"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err and "/runs/x/report.md" in err
    assert err.startswith("fedpate data: error:")



def _wait_for_interrupt(ready, seconds):
    # a worker of pytest-xdist ignores SIGINT, and a forked child inherits that: listen as a terminal's program does
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        ready.set()
        time.sleep(seconds)
    except KeyboardInterrupt:
        raise SystemExit(130) from None


def _ignore_interrupts(ready, seconds):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ready.set()
    time.sleep(seconds)


@pytest.mark.skipif(os.name != "posix", reason="SIGINT to a process")
def test_workers_are_interrupted_when_only_the_parent_was():
    """``kill -INT <parent>`` reaches the parent alone: it passes the interrupt on instead of waiting for the
    workers to finish their cells, and terminates a worker that does not stop."""
    import multiprocessing

    from sim.runners.compare import stop_workers

    context = multiprocessing.get_context("fork")   # plain sleepers: nothing to import
    events = [context.Event(), context.Event()]
    listening = context.Process(target=_wait_for_interrupt, args=(events[0], 60))
    deaf = context.Process(target=_ignore_interrupts, args=(events[1], 60))
    try:
        for process, ready in zip((listening, deaf), events):
            process.start()
            assert ready.wait(30)
        started = time.monotonic()
        stop_workers([listening, deaf], grace=0.2, interrupt_wait=2.0)
        assert time.monotonic() - started < 15
    finally:
        for process in (listening, deaf):
            if process.is_alive():
                process.kill()
                process.join()
    assert listening.exitcode == 130            # interrupted, ended quietly
    assert deaf.exitcode == -signal.SIGTERM     # did not stop: terminated


@pytest.mark.parametrize("extra", [[], ["--seeds", "0,1"]])
def test_a_second_compare_into_a_folder_being_written_is_refused_in_one_line(capsys, tmp_path, extra):
    """Two comparisons into one --out at once: the second says so in one line and touches nothing there (the
    first holds the folder: an advisory lock of the folder itself, so no lock file is left behind)."""
    from task.io import writing_folder

    out = tmp_path / "run"
    out.mkdir()
    with writing_folder(out):   # the first run, still writing
        line = _one_line_error(capsys, ["compare", "--preset", "tiny", "--methods", "public-only", "--epsilons", "1",
                                        "--no-progress", "--out", str(out), *extra])
    assert "another run is writing this folder" in line
    assert list(out.iterdir()) == []
    with writing_folder(out):   # released when the holder ends: the next run may take it
        pass


def test_a_corrupt_hospital_ledger_line_is_named_with_what_to_do_before_anything_runs(capsys, tmp_path, monkeypatch):
    """A hospital ledger edited by hand (line 2 no longer a record): one line naming the file, the line and what to
    do, before any cell or worker opens it -- not worker tracebacks followed by resume advice that fails again."""
    import sim.runners.compare as compare
    from privacy.events import GaussianEvent
    from privacy.ledger import Ledger

    monkeypatch.setattr(compare, "build_world", lambda *a, **k: pytest.fail("the comparison started"))
    out = tmp_path / "run"
    path = out / "hospital-ledgers" / "h0.jsonl"
    ledger = Ledger(path)
    for index in range(3):
        ledger.record(["h0"], GaussianEvent(0.25, 1.0), f"q{index}")
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + lines[1].replace('"event"', '"evnt"') + lines[2])
    line = _one_line_error(capsys, ["compare", "--preset", "tiny", "--methods", "public-only", "--epsilons", "1",
                                    "--no-progress", "--out", str(out)], flag=str(path))
    assert "line 2" in line and "restore h0.jsonl from a backup" in line and "new --out" in line


def test_simulate_silences_the_library_notices_a_user_need_not_see(capsys, caplog):
    """Flower's deprecation notice of run_simulation and Ray's tip on CUDA_VISIBLE_DEVICES are fedpate's to act
    on, not the user's; any other warning still shows."""
    import logging
    import warnings

    from sim.runners.simulation import quiet_flower

    flower = logging.getLogger("flwr")
    with caplog.at_level(logging.WARNING, logger="flwr"), warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with quiet_flower():
            flower.warning("DEPRECATED FEATURE: The `run_simulation` function is deprecated")
            warnings.warn("Tip: In future versions of Ray, Ray will no longer override accelerator visible devices",
                          FutureWarning)
            flower.warning("a SuperNode did not reply")
            warnings.warn("something else", FutureWarning)
    assert [r.getMessage() for r in caplog.records] == ["a SuperNode did not reply"]
    assert [str(w.message) for w in shown] == ["something else"]

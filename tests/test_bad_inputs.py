"""A newcomer's first day, as a table: every command and flag family given a bad input gets one line naming the
flag or file (exit status 2, or 1 for the machine's own errors), no traceback, and no work started -- no world
built, no model trained, no certificate made, nothing charged.

Each row runs in this process through ``sim.cli.main`` with the commands' expensive first steps replaced by a
tripwire (:class:`WorkStarted`, outside every error type the command line catches), so a bad input that starts
work fails its row instead of running for minutes. Cheap: the whole table runs in seconds.
"""

from __future__ import annotations

import pytest

from sim.cli import main


class WorkStarted(BaseException):
    """A command began real work on an input it should have refused."""


@pytest.fixture
def no_work(monkeypatch):
    import sim.deployment.fedpate_local as fedpate_local
    import sim.deployment.local as local
    import sim.deployment.tls as tls
    import sim.runners.central as central
    import sim.runners.classification_compare as classification
    import sim.runners.compare as compare
    import sim.runners.simulation as simulation
    import task.data.gallery as gallery
    import task.data.phantoms as phantoms
    import task.data.preprocess as preprocess
    import task.reporting.predict as predict

    def tripwire(what):
        def started(*args, **kwargs):
            raise WorkStarted(what)
        return started

    for module, name in [(central, "load_central_data"), (central, "public_start"), (compare, "build_world"),
                         (compare, "materialise_world"), (simulation, "materialise_world"),
                         (classification, "run_classification_compare"), (phantoms, "generate_phantoms"),
                         (preprocess, "prepare_dataset"), (gallery, "render_gallery"), (predict, "predict_scans"),
                         (predict, "evaluate_scans"), (tls, "make_certificates"), (local, "LocalDeployment"),
                         (fedpate_local, "run_local_deployment"), (fedpate_local, "materialise_world")]:
        monkeypatch.setattr(module, name, tripwire(f"{module.__name__}.{name}"))


@pytest.fixture(scope="module")
def shared_places(tmp_path_factory):
    """What the rows name: a regular file, an empty folder, a folder that does not exist, ledgers with a corrupt
    line, a labelled BraTS folder (and one of its cases alone), one with a truncated file, a run folder
    without a model, a certificates folder without keys, a Flower app folder without pyproject.toml."""
    from privacy.events import GaussianEvent
    from privacy.ledger import Ledger
    from test_realcheck import truncated_cases, write_cases

    tmp_path = tmp_path_factory.mktemp("places")
    file = tmp_path / "a-file.txt"
    file.write_text("not a folder\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    corrupt = tmp_path / "corrupt.jsonl"
    ledger = Ledger(corrupt)
    for index in range(3):
        ledger.record(["h0"], GaussianEvent(0.25, 1.0), f"q{index}")
    lines = corrupt.read_text().splitlines(keepends=True)
    corrupt.write_text(lines[0] + "{not json\n" + lines[2])
    compare_corrupt = tmp_path / "cmp-corrupt"
    (compare_corrupt / "hospital-ledgers").mkdir(parents=True)
    (compare_corrupt / "hospital-ledgers" / "h0.jsonl").write_text(corrupt.read_text())
    cases = write_cases(tmp_path / "brats", "brats2023")
    cut = truncated_cases(tmp_path / "cut")
    no_model = tmp_path / "no-model"
    no_model.mkdir()
    certs = tmp_path / "certs"
    certs.mkdir()
    (tmp_path / "not-json.jsonl").write_text("hello\nworld\n")
    (tmp_path / "dataset-broken").mkdir()
    (tmp_path / "dataset-broken" / "dataset.json").write_text("{broken")
    return {"file": file, "empty": empty, "absent": tmp_path / "absent", "corrupt": corrupt,
            "cmp_corrupt": compare_corrupt, "cases": cases, "case": cases / "Case000", "cut": cut,
            "no_model": no_model, "certs": certs, "not_json": tmp_path / "not-json.jsonl",
            "dataset_broken": tmp_path / "dataset-broken", "png": tmp_path / "g.png", "tmp": tmp_path}


@pytest.fixture
def places(shared_places, tmp_path):
    """The shared places, and this row's own --out (which a refused command must not create)."""
    return {**shared_places, "out": tmp_path / "out"}


# (command line with {places}, what the one line must contain)
BAD = [
    # --- the command itself
    ("", "required: COMMAND"),
    ("nope", "invalid choice: 'nope'"),
    ("privacy", "required: ACTION"),
    ("data", "required: ACTION"),
    ("deploy", "required: STEP"),
    ("privacy nope", "invalid choice"),
    ("data nope", "invalid choice"),
    ("deploy nope", "invalid choice"),
    ("central --out {out} --method dp-sgd --no-such-flag", "unrecognized arguments: --no-such-flag"),
    ("compare --out {out} --epsilon 2", "--epsilons 2"),
    # --- privacy calibrate
    ("privacy calibrate --epsilon 0", "--epsilon"),
    ("privacy calibrate --epsilon -1", "--epsilon"),
    ("privacy calibrate --epsilon nan", "--epsilon"),
    ("privacy calibrate --epsilon inf", "--epsilon"),
    ("privacy calibrate --epsilon abc", "--epsilon"),
    ("privacy calibrate --delta 0", "--delta"),
    ("privacy calibrate --delta 1", "--delta"),
    ("privacy calibrate --delta 2", "--delta"),
    ("privacy calibrate --queries 0", "--queries"),
    ("privacy calibrate --queries -3", "--queries"),
    ("privacy calibrate --queries 1.5", "--queries"),
    ("privacy calibrate --teachers 0", "--teachers"),
    ("privacy calibrate --teachers x", "--teachers"),
    ("privacy calibrate --compressor nope", "--compressor"),
    ("privacy calibrate --compressor pca", "--dim"),
    ("privacy calibrate --compressor clip", "--clip"),
    ("privacy calibrate --compressor naive", "--voxels"),
    ("privacy calibrate --compressor pca --dim 0", "--dim"),
    ("privacy calibrate --compressor clip --clip 0", "--clip"),
    ("privacy calibrate --compressor clip --clip -2", "--clip"),
    ("privacy calibrate --compressor naive --voxels 0", "--voxels"),
    # --- privacy spent
    ("privacy spent {absent}", "does not exist"),
    ("privacy spent {empty}", "does not exist"),
    ("privacy spent {corrupt}", "line 2"),
    ("privacy spent {not_json}", "line 1"),
    ("privacy spent {corrupt} --delta 0", "--delta"),
    ("privacy spent {corrupt} --delta 1.5", "--delta"),
    ("privacy spent {corrupt} --relation nope", "--relation"),
    ("privacy spent", "required: ledger"),
    # --- data phantoms
    ("data phantoms --out {out} --cases 0", "--cases"),
    ("data phantoms --out {out} --cases -1", "--cases"),
    ("data phantoms --out {out} --cases x", "--cases"),
    ("data phantoms --out {out}", "required: --cases"),
    ("data phantoms --cases 4", "required: --out"),
    ("data phantoms --out {out} --cases 4 --institutions 0", "--institutions"),
    ("data phantoms --out {out} --cases 4 --seed -1", "--seed"),
    ("data phantoms --out {out} --cases 4 --resolution 0", "--resolution"),
    ("data phantoms --out {out} --cases 4 --resolution -2", "--resolution"),
    ("data phantoms --out {out} --cases 4 --test-cases -1", "--test-cases"),
    ("data phantoms --out {out} --cases 4 --workers 0", "--workers"),
    ("data phantoms --out {out} --cases 4 --shift nope", "nope"),
    ("data phantoms --out {out} --cases 4 --layout nope", "--layout"),
    ("data phantoms --out {file}/x --cases 4", "--out"),
    ("data phantoms --out {file} --cases 4", "--out"),
    # --- data inspect
    ("data inspect {absent}", "absent"),
    ("data inspect {file}", "a-file.txt"),
    ("data inspect {empty}", "empty"),
    ("data inspect {dataset_broken}", "dataset.json"),
    ("data inspect {cases} --layout nope", "--layout"),
    ("data inspect {cases} --layout brats2021", "BraTS 2021"),
    ("data inspect {cut}", "Case000-t2w.nii.gz"),
    ("data inspect", "required: dir"),
    # --- data prepare
    ("data prepare {cases} --out {out} --grid 0", "--grid"),
    ("data prepare {cases} --out {out} --grid abc", "--grid"),
    ("data prepare {cases} --out {out} --grid 1,2", "--grid"),
    ("data prepare {cases} --out {out} --grid 32,32,1", "--grid"),
    ("data prepare {cases} --out {out} --margin -1", "--margin"),
    ("data prepare {cases} --out {file}/x", "--out"),
    ("data prepare {cases}", "required: --out"),
    # --- data gallery
    ("data gallery {cases} --out {png} --cases 0", "--cases"),
    ("data gallery {cases} --out {png} --cases -1", "--cases"),
    ("data gallery {cases} --out {png} --cases x", "--cases"),
    ("data gallery {cases} --out {tmp}", "is a folder"),
    ("data gallery {cases} --out {file}/g.png", "--out"),
    ("data gallery {cases}", "required: --out"),
    # --- central
    ("central --out {out}", "required: --method"),
    ("central --out {out} --method nope", "--method"),
    ("central --method dp-sgd", "required: --out"),
    ("central --out {out} --method dp-sgd --epsilon 0", "--epsilon"),
    ("central --out {out} --method dp-sgd --epsilon -1", "--epsilon"),
    ("central --out {out} --method dp-sgd --epsilon nan", "--epsilon"),
    ("central --out {out} --method dp-sgd --epsilon inf", "--epsilon"),
    ("central --out {out} --method dp-sgd --delta 0", "--delta"),
    ("central --out {out} --method dp-sgd --delta 1", "--delta"),
    ("central --out {out} --method dp-sgd --seed -1", "--seed"),
    ("central --out {out} --method dp-sgd --seed 1.5", "--seed"),
    ("central --out {out} --method dp-sgd --preset nope", "--preset"),
    ("central --out {out} --method dp-sgd --epochs 0", "--epochs"),
    ("central --out {out} --method dp-sgd --batch-size 0", "--batch-size"),
    ("central --out {out} --method dp-sgd --learning-rate 0", "--learning-rate"),
    ("central --out {out} --method dp-sgd --max-grad-norm -1", "--max-grad-norm"),
    ("central --out {out} --method dp-sgd --noise-multiplier 0", "--noise-multiplier"),
    ("central --out {out} --method dp-sgd --noise-mode nope", "--noise-mode"),
    ("central --out {out} --method dp-sgd --noise-mode schedule", "--schedule"),
    ("central --out {out} --method dp-sgd --schedule nope", "--schedule"),
    ("central --out {out} --method dp-sgd --sampling nope", "--sampling"),
    ("central --out {out} --method dp-sgd --relation nope", "--relation"),
    ("central --out {out} --method dp-sgd --sampling shuffle --relation add-remove", "--relation"),
    ("central --out {out} --method dp-sgd --trainable nope", "--trainable"),
    ("central --out {out} --method dp-sgd --grad-sample-mode nope", "--grad-sample-mode"),
    ("central --out {out} --method dp-sgd --augmentation-multiplicity 0", "--augmentation-multiplicity"),
    ("central --out {out} --method dp-sgd --ema-decay 1", "--ema-decay"),
    ("central --out {out} --method dp-sgd --ema-decay -0.1", "--ema-decay"),
    ("central --out {out} --method dp-sgd --init nope", "--init"),
    ("central --out {out} --method dp-sgd --selection nope", "--selection"),
    ("central --out {out} --method dp-sgd --selection private --noise-mode fixed", "--selection private"),
    ("central --out {out} --method dp-sgd --selection private --init scratch", "--selection private"),
    ("central --out {out} --method dp-sgd --selection private --selection-heldout 1", "--selection-heldout"),
    ("central --out {out} --method dp-sgd --selection private --selection-score-noise 0", "--selection-score-noise"),
    ("central --out {out} --method dp-sgd --selection private --selection-mean 0.5", "--selection-mean"),
    ("central --out {out} --method dp-sgd --selection private --selection-shape -1", "--selection-shape"),
    ("central --out {out} --method dp-sgd --data {absent}", "--data"),
    ("central --out {out} --method dp-sgd --layout msd", "--layout"),
    ("central --out {out} --method dp-sgd --partition-file {file}", "--partition-file"),
    ("central --out {out} --method dp-sgd --precision 16", "--precision"),
    ("central --out {out} --method dp-sgd --device nope", "--device"),
    ("central --out {out} --method dp-sgd --device cuda:x", "--device"),
    ("central --out {out} --method dp-sgd --device cuda", "cuda"),
    ("central --out {out} --method dp-sgd --real-check {absent}", "--real-check"),
    ("central --out {out} --method dp-sgd --real-check {file}", "--real-check"),
    ("central --out {out} --method dp-sgd --real-check {cut}", "Case000-t2w.nii.gz"),
    ("central --out {out} --method dp-sgd --real-check {cases} --real-check {cases}", "twice"),
    ("central --out {file}/run --method nonprivate", "--out"),
    # --- simulate
    ("simulate --out {out} --method nope", "--method"),
    ("simulate --out {out} --hospitals 0", "--hospitals"),
    ("simulate --out {out} --hospitals -2", "--hospitals"),
    ("simulate --out {out} --teachers-per-hospital 0", "--teachers-per-hospital"),
    ("simulate --out {out} --epsilon 0", "--epsilon"),
    ("simulate --out {out} --delta 2", "--delta"),
    ("simulate --out {out} --seed -1", "--seed"),
    ("simulate --out {out} --preset nope", "--preset"),
    ("simulate --out {out} --engine nope", "--engine"),
    ("simulate --out {out} --calibration nope", "--calibration"),
    ("simulate --out {out} --init nope", "--init"),
    ("simulate --out {out} --secure-colluders -1", "--secure-colluders"),
    ("simulate --out {out} --secure-dropouts x", "--secure-dropouts"),
    ("simulate --out {out} --secure-threshold -1", "--secure-threshold"),
    ("simulate --out {out} --method pate-anchored-secure --secure-threshold 1", "threshold 1 must be at least 2"),
    ("simulate --out {out} --method pate-anchored-secure --secure-threshold 99", "threshold 99 exceeds"),
    ("simulate --out {out} --method pate-anchored-secure --hospitals 1", "needs at least 2"),
    ("simulate --out {out} --method dp-fedavg-secure --hospitals 1", "needs at least 2"),
    ("simulate --out {out} --method dp-fedavg-secure --secure-colluders 2", "no honest noise share"),
    ("simulate --out {out} --method pate-anchored-secure --secure-dropouts 1", "1 hospitals left"),
    ("simulate --out {out} --data {absent}", "absent"),
    ("simulate --out {out} --layout brats2023", "--layout"),
    ("simulate --out {out} --device nope", "--device"),
    ("simulate --out {out} --precision x", "--precision"),
    ("simulate --out {out} --real-check {absent}", "--real-check"),
    ("simulate --out {out} --real-check {cut}", "Case000-t2w.nii.gz"),
    ("simulate --out {out} --engine runtime --real-check {cases}", "--real-check"),
    ("simulate --out {file}/run", "--out"),
    # --- compare
    ("compare --out {out} --methods ''", "--methods: empty list"),
    ("compare --out {out} --methods ,", "--methods: empty list"),
    ("compare --out {out} --methods nope", "--methods: unknown nope"),
    ("compare --out {out} --methods pate-ae,nope", "--methods: unknown nope"),
    ("compare --out {out} --epsilons ''", "--epsilons: empty list"),
    ("compare --out {out} --epsilons 0", "--epsilons"),
    ("compare --out {out} --epsilons -1", "--epsilons"),
    ("compare --out {out} --epsilons abc", "--epsilons"),
    ("compare --out {out} --epsilons nan", "--epsilons"),
    ("compare --out {out} --epsilons 1,inf", "--epsilons"),
    ("compare --out {out} --seeds ''", "--seeds: empty list"),
    ("compare --out {out} --seeds -1", "--seeds"),
    ("compare --out {out} --seeds a", "--seeds"),
    ("compare --out {out} --seeds 0,0", "--seeds"),
    ("compare --out {out} --teachers-per-hospital 0", "--teachers-per-hospital"),
    ("compare --out {out} --teachers-per-hospital ''", "--teachers-per-hospital: empty list"),
    ("compare --out {out} --teachers-per-hospital a", "--teachers-per-hospital"),
    ("compare --out {out} --teachers-per-hospital 2,-4", "--teachers-per-hospital"),
    ("compare --out {out} --hospitals 0", "--hospitals"),
    ("compare --out {out} --lifetime-epsilon 0", "--lifetime-epsilon"),
    ("compare --out {out} --lifetime-epsilon -1", "--lifetime-epsilon"),
    ("compare --out {out} --workers 0", "--workers"),
    ("compare --out {out} --workers x", "--workers"),
    ("compare --out {out} --workers 2 --engine flower", "--workers 2"),
    ("compare --out {out} --engine runtime", "--engine"),
    ("compare --out {out} --task nope", "--task"),
    ("compare --out {out} --task mnist5k --seeds 0,1", "--seeds"),
    ("compare --out {out} --task mnist5k --real-check {cases}", "--real-check"),
    ("compare --out {out} --task mnist5k --teachers-per-hospital 1,2", "--teachers-per-hospital"),
    ("compare --out {out} --init nope", "--init"),
    ("compare --out {out} --delta 2", "--delta"),
    ("compare --out {out} --seed -1", "--seed"),
    ("compare --out {out} --precision x", "--precision"),
    ("compare --out {out} --device nope", "--device"),
    ("compare --out {out} --device cuda", "cuda"),
    ("compare --out {out} --layout msd", "--layout"),
    ("compare --out {out} --methods pate-anchored-secure --epsilons 8 --secure-threshold 99", "threshold 99 exceeds"),
    ("compare --out {out} --methods dp-fedavg-secure --epsilons 1 --hospitals 1", "needs at least 2"),
    ("compare --out {out} --real-check {cut}", "Case000-t2w.nii.gz"),
    ("compare --out {cmp_corrupt} --methods public-only --epsilons 1", "line 2"),
    ("compare --out {file}/run --methods public-only", "--out"),
    # --- deploy certs
    ("deploy certs --out {out} --hospitals 0", "--hospitals"),
    ("deploy certs --out {out} --hospitals x", "--hospitals"),
    ("deploy certs --out {out}", "required: --hospitals"),
    ("deploy certs --out {file}/c --hospitals 2", "--out"),
    # --- deploy commands
    ("deploy commands --certs {absent} --superlink agg:9093 --hospital h0=/d", "--certs"),
    ("deploy commands --certs {certs} --superlink agg:9093 --hospital h0=/d", "no roster.txt"),
    ("deploy commands --certs {certs} --superlink agg --hospital h0=/d", "--superlink"),
    ("deploy commands --certs {certs} --superlink agg:port --hospital h0=/d", "--superlink"),
    ("deploy commands --certs {certs} --superlink agg:9093 --hospital h0", "--hospital"),
    ("deploy commands --certs {certs} --superlink agg:9093 --hospital =/d", "--hospital"),
    ("deploy commands --certs {certs} --superlink agg:9093 --hospital h0=/d --hospital h0=/e", "--hospital"),
    ("deploy commands --certs {certs} --superlink agg:9093 --hospital h0=/d --epsilon-budget 0", "--epsilon-budget"),
    ("deploy commands --certs {certs} --superlink agg:9093 --hospital h0=/d --teachers-per-hospital 0",
     "--teachers-per-hospital"),
    ("deploy commands --certs {certs} --superlink agg:9093 --hospital h0=/d --device nope", "--device"),
    ("deploy commands --certs {certs} --superlink agg:9093 --hospital h0=/d --precision 16", "--precision"),
    ("deploy commands --certs {certs} --superlink agg:9093", "required: --hospital"),
    # --- deploy local
    ("deploy local --out {out} --hospitals 0", "--hospitals"),
    ("deploy local --out {out} --hospitals 2 -c nokey", "-c"),
    ("deploy local --out {out} --hospitals 2 -c no-such-key=1", "-c"),
    ("deploy local --out {out} --hospitals 2 -c reproducible-noise=true", "reproducible-noise"),
    ("deploy local --out {out} --hospitals 2 -c method=nope", "method"),
    ("deploy local --out {out} --hospitals 2 -c epsilon=-1", "epsilon"),
    ("deploy local --out {out} --hospitals 2 -c method=pate-anchored-secure -c secure-threshold=1",
     "set by hospitals, secure-colluders"),
    ("deploy local --out {out} --hospitals 1 -c method=pate-anchored-secure", "needs at least 2"),
    ("deploy local --out {out} --hospitals 2 --hospital-data h0", "--hospital-data"),
    ("deploy local --out {out} --hospitals 2 --hospital-data h9=/d", "--hospital-data"),
    ("deploy local --out {out} --hospitals 2 --app {empty}", "--app"),
    ("deploy local --out {out} --hospitals 2 --epsilon-budget 0", "--epsilon-budget"),
    ("deploy local --out {out} --hospitals 2 --teachers-per-hospital -1", "--teachers-per-hospital"),
    ("deploy local --out {out} --hospitals 2 --timeout 0", "--timeout"),
    ("deploy local --out {out} --hospitals 2 --device cuda", "cuda"),
    ("deploy local --out {out} --hospitals 2 --precision 16", "--precision"),
    ("deploy local --out {file}/x --hospitals 2", "--out"),
    # --- predict
    ("predict --model {absent} --image {case} --out {out}", "absent"),
    ("predict --model {no_model} --image {case} --out {out}", "no-model"),
    ("predict --model {no_model} --out {out}", "required: --image"),
    ("predict --model {no_model} --image {case} --out {out} --labels nope", "--labels"),
    ("predict --model {no_model} --image {case} --out {out} --device nope", "--device"),
    ("predict --model {no_model} --image {case} --out {out} --precision 8", "--precision"),
    # --- evaluate
    ("evaluate --model {no_model} --data {cases} --limit 0", "--limit"),
    ("evaluate --model {no_model} --data {cases} --limit -1", "--limit"),
    ("evaluate --model {no_model} --data {cases} --limit x", "--limit"),
    ("evaluate --model {no_model} --data {cases} --layout nope", "--layout"),
    ("evaluate --model {no_model} --data {cases} --labels nope", "--labels"),
    ("evaluate --model {no_model} --data {cases} --json {tmp}", "--json"),
    ("evaluate --model {no_model} --data {cases} --out {file}/x", "--out"),
    ("evaluate --model {no_model} --data {cases} --device nope", "--device"),
    ("evaluate --data {cases}", "required: --model"),
    # --- demo
    ("demo --out {out} --preset paper", "--preset"),
    ("demo --out {out} --seed -1", "--seed"),
    ("demo --out {out} --workers 0", "--workers"),
    ("demo --out {out} --workers x", "--workers"),
    ("demo --out {out} --engine runtime", "--engine"),
    ("demo --out {out} --init nope", "--init"),
    ("demo --out {out} --device nope", "--device"),
    ("demo --out {out} --real-check {absent}", "--real-check"),
    ("demo --out {out} --real-check {cut}", "Case000-t2w.nii.gz"),
    ("demo --out {file}/demo", "--out"),
]


def _argv(template: str, places: dict) -> list[str]:
    import shlex

    return shlex.split(template.format(**places))


@pytest.mark.parametrize("template,said", BAD, ids=[template or "(nothing)" for template, _ in BAD])
def test_a_bad_input_gets_one_line_naming_it_and_starts_no_work(capsys, no_work, places, template, said):
    argv = _argv(template, places)
    if argv and argv[0] in ("central", "simulate", "compare", "demo") and "--preset" not in argv:
        argv += ["--preset", "tiny"]
    try:
        status = main(argv)
    except SystemExit as stopped:   # refused by the parser
        status = stopped.code
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert status in (1, 2), (status, captured.out, captured.err)
    assert "Traceback" not in captured.err and len(lines) == 1, captured.err
    assert lines[0].startswith("fedpate") and "error:" in lines[0], lines[0]
    assert said.format(**places) in lines[0], lines[0]
    assert not places["out"].exists() or template.startswith("deploy local"), "a refused run left its --out"
    # it names only flags this command has, and no internal setting (``federation.teachers_per_hospital``)
    import re

    # (a flag the user typed is named as typed; a command quoted in backticks is another command's own)
    said_outside_quotes = re.sub(r"`[^`]*`", "", lines[0].replace(str(places["tmp"]), ""))
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", said_outside_quotes)) - set(argv)
    assert flags <= _options(argv), (flags - _options(argv), lines[0])
    assert not re.search(r"\b(federation|world|teacher|student|codec|dp_sgd)\.[a-z_]+", lines[0]), lines[0]


def _options(argv: list[str]) -> set[str]:
    """Every option string of the (sub)command ``argv`` names (``fedpate --help`` when it names none)."""
    import argparse

    from sim.cli import build_parser

    parser = build_parser()
    for word in argv:
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not actions or word not in actions[0].choices:
            break
        parser = actions[0].choices[word]
    return {option for action in parser._actions for option in action.option_strings}


def test_the_table_covers_every_command():
    """Every command and subcommand of ``fedpate --help`` has rows above."""
    import argparse

    from sim.cli import build_parser
    from test_cli_help import _commands

    leaves = {" ".join(path[1:]) for path, parser in _commands(build_parser())
              if path[1:] and not any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)}
    covered = {" ".join(template.split()[:2]) if template.split()[:1] in (["privacy"], ["data"], ["deploy"])
               else template.split()[0] for template, _ in BAD if template}
    assert leaves <= covered, sorted(leaves - covered)
    assert len(BAD) >= 178

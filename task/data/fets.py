"""FeTS-style partition files: ``Partition_ID,Subject_ID`` -- real institutions as hospitals.

FeTS 2022 ships ``partitioning_1.csv`` (23 institutions) and ``partitioning_2.csv`` (33: institutions further
split by tumour size) over BraTS 2021's 1,251 subjects; federated brain-tumour papers use them as their sites.
This module reads such a file and decides which partitions become hospitals; ``task.world`` turns the answer
into a split.

The rule (stated in the report's World section, :data:`RULE`):

* each partition is one hospital; with ``--hospitals H`` only the H largest partitions (by subjects found in
  the data; ties by the order of first appearance in the file) are hospitals, the others are left out entirely
  (neither private nor public nor test), so no hospital mixes two institutions;
* the test patients and the public sets (query, reference, validation) are held out *from each hospital
  proportionally* (stratified over the chosen partitions, largest remainders), as every split of this product
  draws them, so public and test data come from the same institutions as the private data;
* cases of the data folder that the file does not list are left out (counted in the World section); a subject
  the file lists but the data lacks is an error (the file belongs to another dataset).
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path
from typing import Callable, Mapping, Sequence

from task.errors import UserError

COLUMNS = ("Partition_ID", "Subject_ID")
RULE = ("each partition of the file is one hospital (the largest H when --hospitals H is given; the others are "
        "left out); test and public patients are held out from each hospital proportionally")


def read_partition_file(path: str | os.PathLike) -> dict[str, str]:
    """``Subject_ID -> Partition_ID`` (file order) of a FeTS partition CSV; a one-line UserError naming the
    file for anything that is not one (missing, binary, no such columns, empty field, subject in two partitions)."""
    path = Path(path)
    where = f"--partition-file {path}"
    if not path.is_file():
        raise UserError(f"{where}: file not found; expected a CSV with columns {','.join(COLUMNS)} (FeTS 2022)")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (UnicodeDecodeError, OSError) as exc:
        raise UserError(f"{where}: not a readable UTF-8 text file ({type(exc).__name__})") from None
    try:
        rows = list(csv.reader(io.StringIO(text)))
    except csv.Error as exc:
        raise UserError(f"{where}: not a CSV file ({exc})") from None
    rows = [[cell.strip() for cell in row] for row in rows if any(cell.strip() for cell in row)]
    if not rows:
        raise UserError(f"{where}: empty; expected a header {','.join(COLUMNS)} and one row per subject")
    header = rows[0]
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        raise UserError(f"{where}: header {','.join(header)[:80]!r} lacks {', '.join(missing)}; expected columns "
                        f"{','.join(COLUMNS)} (FeTS 2022 partitioning_1.csv)")
    ip, isub = header.index("Partition_ID"), header.index("Subject_ID")
    out: dict[str, str] = {}
    for line, row in enumerate(rows[1:], start=2):
        if len(row) <= max(ip, isub) or not row[ip] or not row[isub]:
            raise UserError(f"{where}: line {line} has an empty Partition_ID or Subject_ID ({','.join(row)[:60]!r})")
        subject, partition = row[isub], row[ip]
        if subject in out and out[subject] != partition:
            raise UserError(f"{where}: line {line}: subject {subject!r} is in partitions {out[subject]} and "
                            f"{partition}; expected each subject in one partition")
        out[subject] = partition
    if not out:
        raise UserError(f"{where}: no subjects; expected one row per subject under the header")
    return out


def partition_label(partition: str) -> str:
    """Institution name of a partition in splits and reports (``partition-3``)."""
    return f"partition-{partition}"


def assign_partitions(path: str | os.PathLike, case_ids: Sequence[str], patient_of: Callable[[str], str],
                      hospitals: int | None) -> tuple[dict[str, str], dict]:
    """(case -> institution name for the cases of the chosen partitions, description for the World section).

    ``Subject_ID`` matches a case id, or a patient id (all that patient's scans, e.g. every timepoint of
    ``BraTS-GLI-00008``). A patient whose scans fall in two partitions is refused: one patient, one hospital.
    """
    subjects = read_partition_file(path)
    where = f"--partition-file {Path(path)}"
    by_patient: dict[str, list[str]] = {}
    for cid in case_ids:
        by_patient.setdefault(patient_of(cid), []).append(cid)
    partition_of: dict[str, str] = {}
    unknown = []
    for subject, partition in subjects.items():
        cases = [subject] if subject in set(case_ids) else by_patient.get(subject)
        if not cases:
            unknown.append(subject)
            continue
        for cid in cases:
            partition_of[cid] = partition
    if unknown:
        raise UserError(f"{where}: {len(unknown)} subject(s) not in the data folder, e.g. {unknown[0]!r}; expected "
                        "the Subject_IDs to be case folder names (or patient ids) of --data")
    for patient, cases in by_patient.items():
        held = {partition_of[c] for c in cases if c in partition_of}
        if len(held) > 1:
            raise UserError(f"{where}: patient {patient!r} has scans in partitions {sorted(held)}; expected one "
                            "patient in one partition")
    order = list(dict.fromkeys(subjects.values()))
    counts = {p: len({patient_of(c) for c, q in partition_of.items() if q == p}) for p in order}
    available = [p for p in order if counts[p]]
    if hospitals is None:
        hospitals = len(available)
    if hospitals > len(available):
        raise UserError(f"--hospitals={hospitals}: {where} has only {len(available)} partition(s) with subjects in "
                        "the data; expected at most that many hospitals")
    chosen = sorted(available, key=lambda p: (-counts[p], order.index(p)))[:hospitals]
    institutions = {c: partition_label(p) for c, p in partition_of.items() if p in chosen}
    left_out = [p for p in available if p not in chosen]
    info = {"file": Path(path).name, "rule": RULE, "partitions": len(available),
            "hospital_partitions": {partition_label(p): counts[p] for p in chosen},
            "left_out_partitions": len(left_out),
            "left_out_patients": sum(counts[p] for p in left_out),
            "unlisted_cases": len([c for c in case_ids if c not in partition_of])}
    return institutions, info


def count_partitions(path: str | os.PathLike) -> int:
    """How many partitions a file names (the default number of hospitals with ``--partition-file``)."""
    return len(set(read_partition_file(path).values()))


def institutions_from(path: Path, case_ids: Sequence[str]) -> Mapping[str, str]:
    """Case -> Partition_ID for a partition file that came with the data (FeTS 2022's ``partitioning_1.csv``
    beside the case folders): the cases' institutions, as an MSD ``dataset.json`` states them (the phantoms
    write their site names there, so a phantom world splits the same in every layout). Lenient (unlisted
    cases keep no institution), since it only labels; ``--partition-file`` is the strict path that decides
    hospitals."""
    subjects = read_partition_file(path)
    return {cid: subjects[cid] for cid in case_ids if cid in subjects}

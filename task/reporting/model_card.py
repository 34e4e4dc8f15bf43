"""MODEL_CARD.md: a model bundle's card in the words a privacy officer reads before a model leaves the simulation.

The card says what the model does; its privacy guarantee (ε with δ, the neighbouring relation in words and what the
guarantee means, the accountant, everything released together with it); its trust model, who could see what
(``task.reporting.trust``: the sentence the comparison report prints for the same method); the data it was trained on, the
network in one line and the preprocessing in words; and its test Dice, on the held-out test patients and on the
real-scan check where one ran (WT, TC and ET, their mean, and how many cases). Then the bundle's fields and digests,
and how to use it. bundle.json keeps every field as JSON beside it (``task.reporting.bundle``): this text is for people, and
``bundle.json`` seals its digest, so the text cannot be edited on its own either.
"""

from __future__ import annotations

from typing import Any, Mapping

from privacy.options import Relation
from task.data.layouts import PHANTOMS_SOURCE, LayoutName
from task.data.partitions import PUBLIC_SOURCE
from task.reporting.trust import PROTECTS, trust_line
from task.world import POPULATION_SOURCE

#: what makes two training sets neighbours under each relation (docs/PRIVACY.md, "Neighbouring relations")
RELATION_MEANING = {
    Relation.REPLACE_ONE: "one patient's data is replaced by another patient's",
    Relation.ADD_REMOVE: "one patient's data is added or removed",
    Relation.ZERO_OUT: "one patient's data is replaced by a record that contributes nothing",
}
#: the collections a world is built from (``task.world``), by the part names their manifests record
COLLECTION_ROLES = {
    POPULATION_SOURCE: "the hospitals' population (the hospitals' patients, the public query scans and the held-out "
                       "test patients)",
    PUBLIC_SOURCE: "another centre's collection (the public labelled data)",
}
LAYOUT_WORDS = {LayoutName.MSD: "Medical Segmentation Decathlon Task01 layout",
                LayoutName.BRATS2021: "BraTS 2021 layout", LayoutName.BRATS2023: "BraTS 2023 layout"}
#: MONAI's activation names as people write them
ACTIVATIONS = {"PRELU": "PReLU", "RELU": "ReLU", "LEAKYRELU": "leaky ReLU", "None": "no"}
#: the test Dice a card shows, in this order (``task.learning.metrics.DICE_KEYS``: ``mean`` is over the three classes)
DICE_COLUMNS = ("WT", "TC", "ET", "mean")


def model_card_markdown(bundle: Mapping[str, Any]) -> str:
    """The card of ``bundle`` (bundle.json's fields) as markdown."""
    card = bundle["card"]
    classes = ", ".join(name for code, name in bundle["labels"].items() if str(code) != "0")
    lines = [f"# Model card — {card['method']}", "",
             f"A brain-tumour segmentation model: from a skull-stripped MRI it labels {classes}. Research use only; "
             "not a medical device.", "", "## Privacy", ""]
    lines += privacy_lines(card)
    lines += ["", "## Data, network and preprocessing", "",
              f"- **Data:** {data_words(card['data_source'], card.get('hospitals'), card.get('teachers'))}.",
              f"- **Network:** {network_words(bundle['network'], bundle['modalities'])}.",
              f"- **Preprocessing** (`fedpate predict` repeats it): {preprocessing_words(bundle['preprocessing'])}.",
              "", "## Test Dice", ""]
    lines += dice_lines(card.get("test_dice"), card["data_source"])
    lines += ["", "## Fields", "", "| field | value |", "|---|---|",
              f"| method | {card['method']} |",
              f"| ε spent / budget | {_fmt(card['epsilon'])} / {_fmt(card['epsilon_budget'])} |",
              f"| δ | {_fmt(card['delta'])} |",
              f"| neighbouring relation | {card['relation'] or 'n/a'} |",
              f"| accountant | {card['accountant'] or 'n/a'} |",
              f"| teachers | {_fmt(card['teachers'])} |",
              f"| hospitals | {_fmt(card['hospitals'])} |",
              f"| public queries | {_fmt(card.get('queries'))} |",
              f"| ledger digest (sha256) | `{card['ledger_digest']}` |",
              f"| weights digest (sha256) | `{bundle['weights_sha256']}` |",
              *[f"| {label} | {card[key]} |" for key, label in (("start", "training started from"),
                                                                ("settings", "training settings"),
                                                                ("device", "trained on device"),
                                                                ("precision", "forward-pass precision"),
                                                                ("note", "note"),
                                                                ("commit", "code commit")) if card.get(key)],
              "", "## Use", "",
              f"Input: 4-channel MRI (MSD order {', '.join(bundle['modalities'].values())}), skull-stripped. "
              f"Output labels: {', '.join(f'{k} {v}' for k, v in bundle['labels'].items())}.", "",
              "```bash", "fedpate predict --model RUN_DIR --image SCAN.nii.gz --out PREDICTIONS/", "```", ""]
    return "\n".join(lines)


def privacy_lines(card: Mapping[str, Any]) -> list[str]:
    """The guarantee in words: ε with δ and the budget, the relation and what it means, the unit, the accountant;
    what was released together; the trust model."""
    if card["private"]:
        meaning = RELATION_MEANING.get(card["relation"])
        lines = [
            f"**({card['epsilon']:.4g}, {card['delta']:g})-differential privacy per patient**: ε = "
            f"{card['epsilon']:.4g} spent of a budget of {_fmt(card['epsilon_budget'])}, at δ = {card['delta']:g}, "
            f"under the **{card['relation']}** neighbouring relation"
            + (f" (two training sets are neighbours when {meaning})" if meaning else "")
            + f", accountant `{card['accountant']}`. So no outcome of the training is more than e^ε times as likely "
            "on one of two neighbouring training sets as on the other, except with probability δ.",
            "",
            "Unit of privacy: one patient (one labelled volume, or every scan of one patient) at one hospital. The ε "
            "is the largest spent by any data owner, recomputed from the run's ledger (`../ledger.jsonl`) at load "
            "time.",
        ]
    else:
        lines = ["**Privacy: none.** This model was trained without a differential-privacy guarantee; it may "
                 "memorise its training patients."]
    release = card.get("released_with")
    if release:
        combined = release.get("combined_epsilon")
        lines += [
            "",
            "**Released together with the other models of its comparison:** every model of that comparison "
            "was trained on the same hospitals' patients, so what they reveal together adds up. Combined: "
            + (f"ε = {combined:.4g} per patient at δ = {release['delta']:g} ({release['relation']}, accountant "
               f"`{release['accountant']}`), the worst hospital's, from the hospitals' own ledgers "
               f"(`{release['hospital_ledgers']}`)." if combined is not None else
               "no private release (the hospitals' ledgers are empty).")
            + " A non-private baseline of that comparison, if shipped too, voids every guarantee.",
        ]
    lines += [
        "",
        "**Trust model.** " + trust_line(card["method"], card.get("aggregation"), card.get("who_sees_what")) + " "
        + PROTECTS[0].upper() + PROTECTS[1:] + "."
        + (" Each hospital keeps its own ledger and lifetime budget and refuses releases beyond it."
           if card["private"] else ""),
    ]
    return lines


def data_words(source: Any, hospitals: int | None = None, teachers: int | None = None) -> str:
    """Where the training data came from, in words: each collection with its role, size and origin."""
    if not isinstance(source, Mapping) or not source:
        return "not recorded"
    if source.get("synthetic"):
        return "synthetic random arrays (a test fixture): no patient's data"
    parts = source.get("parts") or [source]
    said = "; ".join(_collection_words(part) for part in parts)
    holders = []
    if hospitals:
        holders.append(f"{hospitals} hospital{'s' if hospitals != 1 else ''}")
    if teachers:
        holders.append(f"{teachers} teacher{'s' if teachers != 1 else ''} in all")
    return said + (f"; the private patients held by {', '.join(holders)}" if holders else "")


def _collection_words(part: Mapping[str, Any]) -> str:
    kind, cases = part.get("kind"), part.get("cases")
    count = f"{cases} " if cases is not None else ""
    if kind == PHANTOMS_SOURCE:
        origin = ", ".join(f"{label} {part[key]}" for key, label in (
            ("generator_version", "generator version"), ("seed", "seed"), ("shift", "shift"),
            ("resolution_mm", "resolution (mm)")) if part.get(key) not in (None, ""))
        what = f"{count}synthetic brain-tumour phantoms (no patient's data{'; ' + origin if origin else ''})"
    elif kind in LAYOUT_WORDS:
        what = f"{count}{'scans' if count else 'the scans'} of the folder `{part.get('name')}` ({LAYOUT_WORDS[kind]})"
    else:
        rest = {k: v for k, v in part.items() if k not in ("name", "prefix", "cases", "parts")}
        what = f"{count}cases: {readable(rest)}" if rest else f"{count}cases"
    role = COLLECTION_ROLES.get(part.get("name"))   # a folder's own name is no role: said in ``what``
    return f"{role}: {what}" if role else what


def network_words(network: Mapping[str, Any], modalities: Mapping[str, str]) -> str:
    """The network in one line."""
    if network.get("architecture", "monai.networks.nets.UNet") != "monai.networks.nets.UNet" or \
            not network.get("channels"):
        return readable(network) if network else "not recorded"
    channels, strides = list(network["channels"]), list(network.get("strides") or [])
    inputs = int(network.get("in_channels", len(modalities)))
    named = f" ({', '.join(modalities.values())})" if inputs == len(modalities) else ""
    units = int(network.get("num_res_units", 1))
    dropout = float(network.get("dropout") or 0.0)
    line = (f"a {network.get('spatial_dims', 3)}-D U-Net (MONAI `UNet`, size `{network.get('preset', 'custom')}`) "
            f"from {inputs} input channels{named} to {network.get('out_channels')} classes: "
            f"{len(channels)} levels of {_listed(channels)} channels"
            + (f" (strides {', '.join(str(s) for s in strides)})" if strides else "")
            + f", {units} residual unit{'s' if units != 1 else ''} per level, {network.get('norm', 'instance')} "
            f"normalisation, {ACTIVATIONS.get(str(network.get('act')), network.get('act'))} activations, "
            + (f"dropout {dropout:g}" if dropout else "no dropout"))
    hidden = network.get("voxel_head_hidden")
    if hidden:
        line += (f"; a voxel head ({hidden} hidden units) corrects its class scores voxel by voxel from those scores "
                 "and the scan")
    return line


def preprocessing_words(preprocessing: Mapping[str, Any]) -> str:
    """What is done to a scan before the network sees it, in words (``task.data.preprocess``)."""
    config = preprocessing.get("config")
    grid = "x".join(str(g) for g in (config or preprocessing).get("grid") or [])
    if not config:
        return f"the scan is resampled to {grid} voxels (no further preprocessing was recorded)"
    steps = [f"each scan is cropped to the brain (its non-zero voxels) with a margin of {config.get('margin_voxels')} "
             "voxels", "each sequence is z-scored inside the brain (the background stays 0)"]
    if config.get("antialias"):
        steps.append("smoothed inside the brain before downsampling (Gaussian anti-aliasing)")
    steps.append(f"resampled to {grid} voxels (trilinear)")
    rest = {k: v for k, v in config.items() if k not in ("grid", "margin_voxels", "antialias")}
    return (", ".join(steps[:-1]) + f" and {steps[-1]}; the labels are mapped back onto the scan's own grid"
            + (f" (also: {readable(rest)})" if rest else ""))


def dice_lines(test_dice: Mapping[str, Any] | None, source: Any) -> list[str]:
    """The test Dice table: the held-out test patients, and the real-scan check where one ran."""
    if not test_dice or not (test_dice.get("test") or test_dice.get("real_check")):
        return ["No test Dice was recorded for this model."]
    kind = (source or {}).get("kind") if isinstance(source, Mapping) else None
    population = "synthetic phantoms" if kind == PHANTOMS_SOURCE else "the training data's population"
    lines = ["| test set | cases | WT | TC | ET | mean over the three classes |", "|---|---|---|---|---|---|"]
    rows = [("test", f"held-out test patients ({population}), never trained on"),
            ("real_check", "real-scan check: labelled real tumours, mean over the cases")]
    for key, label in rows:
        found = test_dice.get(key)
        if not found:
            continue
        references = found.get("references") or {}
        if references:
            label += " (" + ", ".join(f"{n} with {'an' if who[0] in 'aeiou' else 'a'} {who}'s reference"
                                      for who, n in sorted(references.items())) + ")"
        lines.append(f"| {label} | {_fmt(found.get('cases'))} | "
                     + " | ".join(_dice(found.get(column)) for column in DICE_COLUMNS) + " |")
    if test_dice.get("inference"):
        lines += ["", f"Scored with {test_dice['inference']}."]
    return lines


def _dice(value: Any) -> str:
    return "—" if value is None else f"{float(value):.3f}"


def _listed(values: list) -> str:
    names = [str(v) for v in values]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + f" and {names[-1]}"


def readable(value: Any, key: str | None = None) -> str:
    """A card field for people, not a parser: ``key value`` pairs (underscores as spaces) separated by commas,
    nested records in parentheses, a grid as ``16x16x16``, other lists by commas, lists of records by semicolons
    (bundle.json keeps the exact JSON)."""
    if isinstance(value, Mapping):
        parts = []
        for name, item in sorted(value.items()):
            text = readable(item, name)
            if isinstance(item, Mapping) or (isinstance(item, (list, tuple)) and item
                                             and all(isinstance(v, Mapping) for v in item)):
                text = f"({text})"
            parts.append(f"{str(name).replace('_', ' ')} {text}")
        return ", ".join(parts)
    if isinstance(value, (list, tuple)):
        if not value:
            return "none"
        if all(isinstance(v, Mapping) for v in value):
            return "; ".join(readable(v) for v in value)
        return ("x" if key == "grid" else ", ").join(readable(v) for v in value)
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None or value == "":
        return "none"
    return _fmt(value)


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)

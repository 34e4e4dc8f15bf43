"""Where tensors live and in which precision the forward passes run (every training path can use the GPU).

One resolver, :func:`resolve_device`, turns what a user wrote (``--device auto|cpu|cuda|cuda:N``, the Flower run
config's ``device`` key, a deployed hospital's node config) into a ``torch.device``. Every party resolves the
spec itself at the point of use: a simulated hospital resolves the run's spec, a deployed hospital its own node
config (its GPU is its own machine's), so a spec travels as a string and ``auto`` means "CUDA when this process
sees one". Asking for CUDA where there is none is a one-line :class:`task.errors.UserError` naming ``--device``,
never a silent fall-back to the CPU (a user who asked for the GPU would otherwise wait days on the CPU).

Precision (``--precision 32|bf16``): :func:`autocast` wraps forward passes in ``torch.autocast(bfloat16)``
where that is safe -- training forward passes and inference. Losses are computed in float32 on the upcast
logits, parameters, optimiser state, DP-SGD's per-sample gradients, their clipping, the noise and the update
stay float32 (``task.learning.dpsgd``); ``tests/test_device.py`` measures how far bf16 moves the per-sample gradient norms
that clipping sees.

The spec check (:func:`check_device_spec`, :func:`check_precision`) is pure string work so that run settings
can validate a spec without importing torch (the command line's start-up stays free of it); torch is imported
only by the functions that need a real device.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

from task.errors import UserError
from task.options import AUTO, Precision, look_up_option

DEVICE_CHOICES = "auto|cpu|cuda|cuda:N"
PRECISIONS = tuple(member.value for member in Precision)   # the --precision choices
DEVICE_HELP = ("where training and inference run: auto (CUDA when this machine has a GPU, else the CPU; default), "
               "cpu, cuda or cuda:N (refused when there is no such GPU)")
PRECISION_HELP = ("forward-pass precision: 32 (float32, default) or bf16 (torch.autocast bfloat16 around forward "
                  "passes; losses, DP-SGD's per-sample clipping, its noise and the weights stay float32)")

_DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def check_device_spec(spec: Any, option: str = "--device") -> str:
    """The normalised device spec string (``auto`` for None/empty); UserError unless it is one of
    auto, cpu, cuda, cuda:N. A ``torch.device`` passes as its string form."""
    if spec is None or (isinstance(spec, str) and not spec.strip()):
        return "auto"
    text = str(spec).strip().lower()
    if not _DEVICE_PATTERN.match(text):
        raise UserError(f"{option}: expected {DEVICE_CHOICES}, got {str(spec)!r}")
    return text


#: the other spellings of each precision users write
_PRECISION_ALIASES = {"fp32": Precision.FP32, "float32": Precision.FP32, "bfloat16": Precision.BF16}


def check_precision(precision: Any, option: str = "--precision") -> Precision:
    """:class:`task.options.Precision` (its string: ``"32"`` or ``"bf16"``); also accepts 32 as an int,
    "fp32"/"float32", "bfloat16". None = 32."""
    text = str(precision if precision is not None else Precision.FP32).strip().lower()
    return look_up_option(_PRECISION_ALIASES.get(text, text), Precision, option)


def resolve_device(spec: Any = "auto", option: str = "--device"):
    """``torch.device`` for ``spec`` (auto | cpu | cuda | cuda:N, or a ``torch.device``, or None = auto).

    ``auto`` is CUDA device 0 when ``torch.cuda.is_available()``, else the CPU. ``cuda``/``cuda:N`` without
    such a GPU raise a one-line UserError naming ``option``: asking for the GPU and silently getting the CPU
    would turn a GPU run of the ``paper`` preset into days on the CPU.
    """
    import torch

    if isinstance(spec, torch.device):
        if spec.type == "cuda":
            _require_cuda(spec.index or 0, str(spec), option)
        return spec
    text = check_device_spec(spec, option)
    if text == AUTO:
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if text == "cpu":
        return torch.device("cpu")
    index = int(text.split(":")[1]) if ":" in text else 0
    _require_cuda(index, text, option)
    return torch.device("cuda", index)


def _require_cuda(index: int, text: str, option: str) -> None:
    import torch

    if not torch.cuda.is_available():
        built = "without CUDA" if torch.version.cuda is None else f"with CUDA {torch.version.cuda} but no GPU is visible"
        raise UserError(f"{option} {text}: no CUDA device on this machine (torch {torch.__version__} built {built}); "
                        "use --device cpu or --device auto")
    count = torch.cuda.device_count()
    if index >= count:
        raise UserError(f"{option} {text}: this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})")


def device_name(device: Any) -> str:
    """How results.json and the model card name a device: ``cpu``, ``cuda:0`` (with the GPU's model when known)."""
    import torch

    device = resolve_device(device)
    if device.type == "cuda":
        index = device.index or 0
        try:
            return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
        except Exception:  # noqa: BLE001 - the name is informative only
            return f"cuda:{index}"
    return str(device)


def autocast(device: Any, precision: str = Precision.FP32):
    """``torch.autocast(device.type, bfloat16)`` at :attr:`Precision.BF16 <task.options.Precision.BF16>`, else a
    no-op context.

    For forward passes only (training and inference): callers compute losses on ``logits.float()`` and never
    run an optimiser step inside it.
    """
    import torch

    if check_precision(precision) is not Precision.BF16:
        return contextlib.nullcontext()
    device_type = getattr(device, "type", None) or str(device).split(":")[0]
    return torch.autocast(device_type=device_type, dtype=torch.bfloat16)


def model_device(model: Any):
    """The device of a module's first parameter (CPU for a module without parameters)."""
    import torch

    for parameter in model.parameters():
        return parameter.device
    return torch.device("cpu")

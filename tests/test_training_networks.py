"""Networks: presets build, are Opacus-compatible, and round-trip through network_config."""

import pytest
import torch
from opacus.validators import ModuleValidator

from task.errors import UserError
from task.learning.networks import UNET_PRESETS, build_unet, build_unet_from_config, min_grid_divisor, network_config


@pytest.mark.parametrize("preset", sorted(UNET_PRESETS))
def test_presets_are_opacus_compatible_and_have_no_inplace_ops(preset):
    model = build_unet(preset)
    assert ModuleValidator.validate(model, strict=False) == []
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert not any(getattr(m, "inplace", False) for m in model.modules())


def test_pooling_levels():
    assert min_grid_divisor("tiny") == 4 and min_grid_divisor("small") == 8 and min_grid_divisor("paper") == 16
    assert UNET_PRESETS["paper"]["channels"] == (16, 32, 64, 128, 256)


def test_forward_shape_and_config_roundtrip():
    torch.manual_seed(0)
    model = build_unet("tiny")
    x = torch.randn(2, 4, 16, 16, 16)
    assert model(x).shape == (2, 4, 16, 16, 16)
    cfg = network_config("tiny")
    import json

    clone = build_unet_from_config(json.loads(json.dumps(cfg)))
    clone.load_state_dict(model.state_dict())
    model.eval(), clone.eval()
    assert torch.equal(model(x), clone(x))


def test_unknown_preset_is_a_user_error():
    with pytest.raises(UserError, match="unet preset"):
        build_unet("huge")

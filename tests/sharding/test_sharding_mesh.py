"""make_meshes: device splitting, colocated meshes, and the errors for shapes that cannot fit."""

import jax
import pytest

from sharding.mesh import make_meshes


def _ids(mesh):
    return [d.id for d in mesh.devices.flat]


def test_split_8_devices_into_trainer_2x2_and_decode_4():
    decode, trainer = make_meshes({"tp": 4}, {"fsdp": 2, "tp": 2})
    assert trainer.axis_names == ("fsdp", "tp")
    assert dict(trainer.shape) == {"fsdp": 2, "tp": 2}
    assert decode.axis_names == ("tp",)
    assert dict(decode.shape) == {"tp": 4}
    assert _ids(trainer) == [0, 1, 2, 3]
    assert _ids(decode) == [4, 5, 6, 7]
    # tp is the innermost axis, so it runs over neighbouring devices.
    assert [d.id for d in trainer.devices[0]] == [0, 1]


def test_missing_axes_default_to_size_one_and_leftover_devices_unused():
    decode, trainer = make_meshes({}, {"tp": 2})
    assert dict(trainer.shape) == {"fsdp": 1, "tp": 2}
    assert dict(decode.shape) == {"tp": 1}
    assert set(_ids(trainer)).isdisjoint(_ids(decode))


def test_colocated_meshes_share_devices():
    decode, trainer = make_meshes({"tp": 4}, {"fsdp": 2, "tp": 2}, colocated=True)
    assert _ids(trainer) == _ids(decode) == [0, 1, 2, 3]
    assert trainer.axis_names == ("fsdp", "tp") and decode.axis_names == ("tp",)


def test_explicit_device_list_is_ordered_by_process_then_id():
    devs = list(reversed(jax.devices()))[:4]  # ids 7, 6, 5, 4
    decode, trainer = make_meshes({"tp": 2}, {"fsdp": 1, "tp": 2}, devices=devs)
    assert _ids(trainer) == [4, 5]
    assert _ids(decode) == [6, 7]


def test_too_many_devices_error_names_shapes_and_count():
    with pytest.raises(ValueError) as e:
        make_meshes({"tp": 4}, {"fsdp": 4, "tp": 2})
    assert str(e.value) == (
        "trainer mesh {'fsdp': 4, 'tp': 2} (8 devices) + decode mesh {'tp': 4} (4 devices) "
        "need 12 devices, have 8"
    )


def test_colocated_errors():
    with pytest.raises(ValueError, match="sizes must be equal"):
        make_meshes({"tp": 2}, {"fsdp": 2, "tp": 2}, colocated=True)
    with pytest.raises(ValueError, match="need 16 devices, have 8"):
        make_meshes({"tp": 16}, {"fsdp": 4, "tp": 4}, colocated=True)


def test_unknown_axis_lists_allowed_ones():
    with pytest.raises(ValueError, match=r"unknown axes \['dp'\]; allowed axes: \('fsdp', 'tp'\)"):
        make_meshes({"tp": 2}, {"dp": 2})
    with pytest.raises(ValueError, match=r"unknown axes \['fsdp'\]; allowed axes: \('tp',\)"):
        make_meshes({"fsdp": 2}, {"tp": 2})


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_bad_axis_size(bad):
    with pytest.raises(ValueError, match="positive int"):
        make_meshes({"tp": bad}, {"tp": 2})

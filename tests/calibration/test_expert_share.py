"""How the processes of a run share each expert group."""

import pytest

from qmoe_jax.calibration.expert_share import ExpertShare


@pytest.mark.parametrize(
    "devices, group, parts",
    [
        ((1,), range(0, 8), [range(0, 8)]),
        ((2, 2), range(0, 8), [range(0, 4), range(4, 8)]),
        ((2, 2), range(16, 23), [range(16, 19), range(19, 23)]),
        ((2, 2, 2, 2), range(0, 2), [range(0, 0), range(0, 1), range(1, 1), range(1, 2)]),
        ((1, 3), range(0, 8), [range(0, 2), range(2, 8)]),
    ],
)
def test_the_parts_of_a_group_are_contiguous_and_cover_it_once(devices, group, parts):
    owned = [ExpertShare(index, devices).owned(group) for index in range(len(devices))]
    assert [list(part) for part in owned] == [list(part) for part in parts]
    assert [e for part in owned for e in part] == list(group)


def test_a_share_outside_the_run_is_refused():
    with pytest.raises(ValueError, match="not a process of the run"):
        ExpertShare(2, (2, 2))
    assert ExpertShare.of_run() == ExpertShare()

"""Device meshes: parsing --mesh text, fitting the devices, mesh coordinates to devices."""

import pytest

from tfmulti.platform.mesh import HybridMesh, MeshError, parse_mesh, resolve_data_axis


@pytest.mark.parametrize(
    "text, expected",
    [
        ("data=2,pipe=2", HybridMesh(2, 2, 1)),
        ("pipe=4", HybridMesh(1, 4, 1)),
        (" tensor=2 , data=3 ", HybridMesh(3, 1, 2)),
        ("data=2,pipe=2,tensor=2", HybridMesh(2, 2, 2)),
    ],
)
def test_parse_mesh_reads_axis_sizes_and_defaults_absent_axes_to_one(text, expected):
    assert parse_mesh(text) == expected


def test_mesh_text_round_trips_through_str():
    mesh = HybridMesh(data=4, pipe=2)
    assert parse_mesh(str(mesh)) == mesh


@pytest.mark.parametrize(
    "text, named",
    [
        ("data=2,pipe", "'pipe', not AXIS=SIZE"),
        ("", "'', not AXIS=SIZE"),
        ("data=2,model=2", "unknown axis 'model'"),
        ("data=2,data=2", "names axis 'data' twice"),
        ("data=0,pipe=2", "Received: 0"),
        ("data=two", "Received: 'two'"),
        ("pipe=1.5", "Received: '1.5'"),
    ],
)
def test_bad_mesh_text_gives_one_error_naming_what_was_received(text, named):
    with pytest.raises(MeshError) as error:
        parse_mesh(text)
    assert named in str(error.value)


def test_mesh_must_use_exactly_the_devices_of_all_workers():
    with pytest.raises(MeshError, match=r"needs data x pipe x tensor = 4 devices.*= 8"):
        parse_mesh("data=2,pipe=2").check_fits(devices_per_worker=4, num_workers=2)
    parse_mesh("data=4,pipe=2").check_fits(devices_per_worker=4, num_workers=2)


def test_each_replica_must_fit_inside_one_worker():
    with pytest.raises(MeshError, match=r"data must be a multiple of the 2 workers"):
        parse_mesh("data=1,pipe=4").check_fits(devices_per_worker=2, num_workers=2)


def test_replica_r_stage_s_is_local_device_r_times_pipe_plus_s():
    mesh = parse_mesh("data=3,pipe=2")
    devices = [f"d{index}" for index in range(6)]
    assert mesh.replica_devices(devices) == [["d0", "d1"], ["d2", "d3"], ["d4", "d5"]]
    assert [mesh.local_device_index(r, s) for r in range(3) for s in range(2)] == list(range(6))


def test_each_worker_holds_data_over_workers_replicas_on_its_own_devices():
    mesh = parse_mesh("data=4,pipe=2")
    assert mesh.local_replicas(num_workers=2) == 2
    assert mesh.replica_devices(["a", "b", "c", "d"], num_workers=2) == [["a", "b"], ["c", "d"]]


def test_tensor_shards_of_a_stage_are_neighbouring_devices():
    mesh = parse_mesh("data=2,pipe=2,tensor=2")
    assert [mesh.local_device_index(1, 1, t) for t in range(2)] == [6, 7]
    with pytest.raises(MeshError, match="needs tensor=1"):
        mesh.replica_devices([str(i) for i in range(8)])
    with pytest.raises(MeshError, match="stage must be in 0..1. Received: stage=2"):
        mesh.local_device_index(0, 2)


@pytest.mark.parametrize(
    "text, devices, expected",
    [
        ("data=auto,pipe=2", 8, "data=4,pipe=2"),
        ("pipe=2,tensor=2,data=auto", 8, "pipe=2,tensor=2,data=2"),
        ("data=auto,pipe=2", None, "data=1,pipe=2"),
        ("data=3,pipe=2", 4, "data=3,pipe=2"),
    ],
)
def test_data_auto_fills_the_devices_with_replicas(text, devices, expected):
    assert resolve_data_axis(text, devices) == expected


@pytest.mark.parametrize("devices", [6, 2])
def test_data_auto_refuses_devices_pipe_times_tensor_does_not_divide(devices):
    with pytest.raises(MeshError, match="replicas of pipe x tensor = 4 devices, but the run"):
        resolve_data_axis("data=auto,pipe=2,tensor=2", devices)

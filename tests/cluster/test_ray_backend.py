"""What `omni.cluster.ray` decides without a Ray cluster: which addresses are Ray's, what a
worker on a Ray node offers, and what a driver without Ray installed is told. (The backend
itself runs on a real Ray cluster: test_ray.py.)"""

from __future__ import annotations

import sys

import pytest
import trio

import omni
from omni.cluster import ClusterError
from omni.cluster.ray import RayCluster, is_ray_address, node_resources, ray_resources


def test_ray_addresses_are_ray_and_ray_urls_only() -> None:
    assert is_ray_address("ray") and is_ray_address("ray://10.0.0.1:10001")
    assert not is_ray_address("tcp://127.0.0.1:7100") and not is_ray_address("rays")
    with pytest.raises(ClusterError, match="not a Ray cluster address"):
        RayCluster("tcp://127.0.0.1:7100")
    with pytest.raises(ValueError, match="workers_per_node"):
        RayCluster("ray", workers_per_node=0)


def test_a_worker_offers_its_ray_nodes_resources_in_omnis_names() -> None:
    ray_node = {"CPU": 8.0, "GPU": 2.0, "memory": 1e10, "object_store_memory": 4e9,
                "node:127.0.0.3": 1.0, "node:__internal_head__": 1.0,
                "accelerator_type:H100": 1.0, "node_b": 1.0}
    assert node_resources(ray_node) == {"cpu": 8.0, "gpu": 2.0, "memory": 1e10, "node_b": 1.0}
    assert node_resources(ray_node, share=2) == {"cpu": 4.0, "gpu": 1.0, "memory": 5e9,
                                                 "node_b": 0.5}
    # what a replica asks for, in Ray's names again (to hold it in Ray's accounting)
    assert ray_resources({"gpu": 1, "cpu": 0, "node_b": 1}) == {"GPU": 1, "node_b": 1}


async def test_without_ray_installed_the_driver_is_told_how_to_get_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if not installed
    with pytest.raises(ClusterError, match=r"pip install 'omni\[ray\]'"):
        async with omni.Runtime(cluster="ray"):
            await trio.sleep(0)


def test_a_token_file_with_ray_is_refused() -> None:
    with pytest.raises(ClusterError, match="token file is not used with a Ray cluster"):
        omni.Runtime(cluster="ray", token_file="cluster.token")

"""``omni run --kv-*``: the graph file's KV_LAYOUT and the tier sizes given on the command line."""

import json
import textwrap

KV_GRAPH = '''
    import torch
    import omni
    from omni.kv import KVLayout

    KV_LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, page_size=16,
                         dtype=torch.float32)

    @omni.node
    async def tiers(x: int) -> dict:
        stats = omni.context().kv.stats()
        return {name: s["capacity"] for name, s in stats.items() if name != "leases"}

    @omni.graph
    def kv_tiers(x: int):
        return tiers(x)
'''


def test_kv_options_size_the_tiers(tmp_path, omni_cli):
    (tmp_path / "kv.py").write_text(textwrap.dedent(KV_GRAPH))
    page = 1 * 2 * 16 * 1 * 8 * 4
    out = omni_cli("run", "kv.py", "--input", "x=1", "--json", "--kv-host", f"{10 * page}",
                   "--kv-disk", f"1MiB:{tmp_path / 'kvdisk'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"output": {"host": 10, "disk": 256}}


def test_a_file_with_a_layout_gets_the_default_tiers(tmp_path, omni_cli):
    (tmp_path / "kv.py").write_text(textwrap.dedent(KV_GRAPH))
    out = omni_cli("run", "kv.py", "--input", "x=1", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert set(json.loads(out.stdout)["output"]) == {"device", "host"}


def test_kv_options_without_a_layout_are_a_usage_error(graphs, omni_cli):
    out = omni_cli("run", "fail.py", "--input", "text=a", "--kv-host", "1GiB", cwd=graphs)
    assert out.returncode == 2
    assert out.stderr.strip() == ("error: fail.py defines no KV_LAYOUT, so --kv-device/"
                                  "--kv-host/--kv-disk have nothing to size; add KV_LAYOUT = "
                                  "omni.kv.KVLayout(...)")


def test_a_bad_tier_size_is_a_usage_error(tmp_path, omni_cli):
    (tmp_path / "kv.py").write_text(textwrap.dedent(KV_GRAPH))
    out = omni_cli("run", "kv.py", "--input", "x=1", "--kv-host", "lots", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.startswith("error: bad KV tier size: not a size: 'lots'")
    assert "Traceback" not in out.stderr


def test_a_tier_too_small_for_a_page_is_a_usage_error(tmp_path, omni_cli):
    (tmp_path / "kv.py").write_text(textwrap.dedent(KV_GRAPH))
    out = omni_cli("run", "kv.py", "--input", "x=1", "--kv-host", "100", cwd=tmp_path)
    assert out.returncode == 2
    assert "tier 'host' holds no page" in out.stderr and "Traceback" not in out.stderr

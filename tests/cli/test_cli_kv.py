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


def test_a_tier_that_cannot_be_made_is_one_line_naming_the_flag(tmp_path, omni_cli):
    """Folders that are files, devices or forbidden, sizes past the file system or the
    shared memory, absurd sizes: each one line, exit 2, naming the flag and the cause."""
    (tmp_path / "kv.py").write_text(textwrap.dedent(KV_GRAPH))
    (tmp_path / "afile").write_text("")
    cases = [
        (["--kv-disk", "16MiB:/dev/null"], "--kv-disk: the disk tier cannot be made: "),
        (["--kv-disk", f"16MiB:{tmp_path / 'afile' / 'sub'}"], "Not a directory"),
        (["--kv-disk", "100TiB:" + str(tmp_path / "big")], "--kv-disk: the disk tier cannot"),
        (["--kv-host", "100000TiB"], "is more than a machine holds"),
        (["--kv-host", "99999999999999999999999GiB"], "is more than a machine holds"),
        (["--kv-host", "60000TiB"], "--kv-host: the host tier cannot be made: "),
    ]
    for args, fragment in cases:
        out = omni_cli("run", "kv.py", "--input", "x=1", *args, cwd=tmp_path)
        lines = [x for x in out.stderr.splitlines()
                 if x.strip() and not x.startswith(("requests", "removed the shared memory"))]
        assert out.returncode == 2 and len(lines) == 1, (args, out.stderr[-2000:])
        assert lines[0].startswith("error: ") and fragment in lines[0], (args, lines)
        assert "metrics" not in lines[0]

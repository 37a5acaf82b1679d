"""The layers together: a graph whose class node serves a TorchEngine from the runtime's KV
store, run twice through `omni run`; the second request reuses the first one's pages."""

import json
import textwrap

from tests._cli import run_omni

GRAPH = '''
    import omni
    from omni.compute import SamplingParams, TorchEngine

    KV_LAYOUT = TorchEngine.tiny(seed=0).kv_layout

    @omni.node
    class Chat:
        def __init__(self):
            self.engine = TorchEngine.tiny(seed=0, store=omni.context().kv)

        async def __call__(self, text: str) -> dict:
            params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
            result = await self.engine.generate(text, params)
            return {"tokens": result.token_ids, "cached_tokens": result.cached_tokens}

    @omni.graph
    def chat(text: str):
        return Chat()(text)
'''


def test_a_second_request_reuses_the_first_ones_kv_through_the_cli(tmp_path):
    (tmp_path / "chat.py").write_text(textwrap.dedent(GRAPH))
    system = "You are a terse assistant. " * 3
    lines = [{"text": system + "Hi."}, {"text": system + "Hello there."}]
    (tmp_path / "turns.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = run_omni("run", str(tmp_path / "chat.py"), "--inputs-json",
                   str(tmp_path / "turns.jsonl"), "--json", "--kv-host", "8MiB")
    assert out.returncode == 0, out.stderr
    first, second = (json.loads(line)["output"] for line in out.stdout.splitlines())
    assert first["cached_tokens"] == 0
    assert second["cached_tokens"] == len(system.encode()) // 16 * 16

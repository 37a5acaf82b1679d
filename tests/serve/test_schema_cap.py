"""A client's response_format schema is bounded before anything of it is compiled: a grammar's
compilation cannot be interrupted and its time grows much faster than its size."""

from __future__ import annotations

import json

import pytest

from omni.serve._errors import ApiError
from omni.serve.openai import ChatPolicy
from omni.serve.openai._chat_models import ChatCompletionRequest
from omni.serve.openai._chat_request import MAX_SCHEMA_BYTES, chat_request
from omni.serve.openai._media import MediaPolicy


def body(properties: int) -> ChatCompletionRequest:
    schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"}
                                               for i in range(properties)}}
    return ChatCompletionRequest.model_validate({
        "model": "chat", "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "wide", "schema": schema}}})


@pytest.mark.parametrize("whitespace", ["any", "compact"])
async def test_a_schema_over_the_cap_is_a_400_naming_the_field(whitespace):
    wide = body(2_000)  # 1,600 optional properties took 27 s to compile on a 2-core machine
    assert len(json.dumps(wide.response_format.json_schema.schema_)) > MAX_SCHEMA_BYTES
    with pytest.raises(ApiError) as refused:
        await chat_request(wide, MediaPolicy(), policy=ChatPolicy(json_whitespace=whitespace))
    assert refused.value.status == 400
    assert refused.value.param == "response_format.json_schema.schema"
    assert f"more than the {MAX_SCHEMA_BYTES:,} this server compiles" in str(refused.value)


async def test_a_schema_under_the_cap_is_taken():
    request = await chat_request(body(100), MediaPolicy(), policy=ChatPolicy())
    assert json.loads(request.sampling["json_schema"])["properties"]["k99"] == {
        "type": "integer"}

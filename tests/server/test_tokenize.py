"""POST /tokenize and /detokenize in vLLM's shapes, and GET /v1/models/{id}."""

import pytest

from server.app import create_app
from server.settings import ServerSettings
from tests.server.test_errors import error_of


async def test_a_prompt_and_messages_are_tokenized(client):
    r = await client.post("/tokenize", json={"prompt": "a bb ccc"})
    assert r.json() == {"count": 3, "max_model_len": 2048, "tokens": [1, 2, 3]}
    r = await client.post("/tokenize", json={"messages": [{"role": "user", "content": "dddd"}]})
    assert r.json()["tokens"] == [4]


async def test_detokenize_spells_the_tokens(client):
    assert (await client.post("/detokenize", json={"tokens": [1, 2]})).json() == {"prompt": "<1><2>"}


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "prompt"),
    ("/tokenize", {"prompt": "x", "colour": 1}, "colour"),
    ("/detokenize", {"tokens": [100]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
])
async def test_bad_bodies_name_their_field(client, path, body, param):
    assert error_of(await client.post(path, json=body), 400)["param"] == param


async def test_a_model_is_found_by_its_name_and_another_is_a_404(engine):
    import httpx

    app = create_app(ServerSettings(served_model_name="smol"), engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        found = await client.get("/v1/models/smol")
        assert found.status_code == 200 and found.json()["id"] == "smol" and found.json()["object"] == "model"
        error = error_of(await client.get("/v1/models/gpt-4o"), 404)
        assert (error["code"], error["param"]) == ("model_not_found", "model")


async def test_without_a_served_name_any_name_is_the_one_model(client):
    r = await client.get("/v1/models/whatever/with-slash")
    assert r.status_code == 200 and r.json()["id"] == "SmolLM2-135M-Instruct"

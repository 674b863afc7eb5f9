"""Replies made ready as JSON by orjson (controller.api_context.fast_json): the heartbeat's, and
submissions'. The JSON must be what the standard encoder (Starlette's JSONResponse, used
before) writes, and a value orjson cannot take must fall back to FastAPI's encoder, never fail.
"""

from __future__ import annotations

import json

from starlette.responses import JSONResponse, Response

from phalanx.controller.api_context import fast_json as _fast_json


def test_the_json_is_the_standard_encoders() -> None:
    body = {
        "start": [{"attempt_id": 7, "env": {"LANG": "C.UTF-8", "NAME": "naïve ☃"}, "x": None}],
        "terms": {"cluster": 3},
        "timing": {"heartbeat_interval": 3.3333333333333335, "fence_timeout": 16.5},
        "ok": True,
    }
    made = _fast_json(body)
    assert isinstance(made, Response)
    assert made.status_code == 200 and made.media_type == "application/json"
    assert json.loads(made.body) == json.loads(JSONResponse(body).body) == body
    assert "naïve ☃".encode() in made.body  # UTF-8, not \\u escapes, as JSONResponse


def test_the_status_code_is_kept() -> None:
    assert _fast_json({"job_id": 1, "job_ids": [1]}, 201).status_code == 201


def test_integer_keys_are_written_as_strings_as_the_standard_encoder_does() -> None:
    made = _fast_json({"by_node": {1: "a"}})
    assert json.loads(made.body) == {"by_node": {"1": "a"}}


def test_a_value_orjson_cannot_take_falls_back_to_the_encoder() -> None:
    made = _fast_json({"big": 2**70}, 201)  # past 64 bits: FastAPI's own encoder, as before
    assert made.status_code == 201
    assert json.loads(made.body) == {"big": 2**70}

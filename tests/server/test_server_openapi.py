"""The published OpenAPI spec matches what the server does: schemathesis generates
requests from it against a real server (stories260k, with an API key) and checks that no
answer is a 5xx and every status code, content type and body is the one the spec declares.
(Driven through schemathesis' CLI: its pytest plugin does not run under pytest 9.)"""
from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from server_harness import serve

from treadle.loaders.resolve import resolve_model

pytestmark = pytest.mark.server  # starts processes (servers, workers)

API_KEY = "sk-test"
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"


@pytest.fixture(scope="module")
def api_server():
    with serve(resolve_model("stories260k"), api_key=API_KEY) as (srv, _):
        yield srv


def test_spec_declares_errors_auth_and_content_types(api_server):
    spec = httpx.get(f"{api_server.url}/openapi.json", timeout=10).json()  # readable without the key
    assert spec["components"]["securitySchemes"]["bearerAuth"] == {"type": "http", "scheme": "bearer"}
    assert spec["security"] == [{"bearerAuth": []}]
    assert "/internal/test/hooks" not in spec["paths"]
    assert list(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert spec["paths"]["/health"]["get"]["security"] == []
    for path, item in spec["paths"].items():
        for method, op in item.items():
            assert "422" not in op["responses"], (method, path)
    cmpl = spec["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "401", "404", "413", "503"} <= set(cmpl)
    assert cmpl["200"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/CompletionResponse"}
    assert "text/event-stream" in cmpl["200"]["content"]


def test_schemathesis_finds_no_5xx_and_no_nonconformance(api_server, tmp_path):
    """A small fixed-seed budget (examples per operation) so it stays well under a minute."""
    cmd = [sys.executable, "-c", "from schemathesis.cli import schemathesis; schemathesis()", "run",
           f"{api_server.url}/openapi.json", "--header", f"Authorization: Bearer {API_KEY}", "--checks", CHECKS,
           "--max-examples", "10", "--seed", "1", "--no-shrink", "--request-timeout", "60",
           "--phases", "examples,coverage,fuzzing", "--report-dir", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path)  # its cache stays there
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "No issues found" in run.stdout or " passed" in run.stdout

"""`minillm serve --help` against README.md: the endpoints it names."""
import re

from conftest import REPO

README = (REPO / "README.md").read_text()


def test_serve_help_names_every_endpoint_the_readme_names():
    """`minillm serve --help` listed ten endpoints; /load, /health, /ping, /invocations and
    /v1/messages/count_tokens, which the README's serve section names, were missing."""
    section = README.split("**Serve.**", 1)[1].split("```", 1)[0]
    section += README.split("**Monitor.**", 1)[0].rsplit("/v1/messages` (Anthropic", 1)[1]
    named = set(re.findall(r"`(?:(?:GET|POST) )?(/[a-z0-9/_]+)`", section)) - {"/v1"}
    assert {"/load", "/invocations", "/v1/messages/count_tokens"} <= named
    from typer.testing import CliRunner

    from minillm.cli import app
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    listed = re.search(r"Endpoints:(.*?)\.\s*$", result.output, flags=re.MULTILINE | re.DOTALL).group(1)
    assert named - set(re.findall(r"/[a-z0-9/_]+", listed)) == set()

"""chat and a model whose chat template does not compile: refused at start-up, naming file and line."""
from __future__ import annotations

import json
from pathlib import Path

from test_cli import STORIES, minillm, needs_stories


# ---- chat and a chat template that does not compile --------------------------------------------------

BROKEN_TEMPLATE = "{% for m in messages %}\n{% endfor %\n"


def stories_with_template(tmp_path: Path, template: str) -> Path:
    """stories260K (its files linked) whose tokenizer_config.json carries TEMPLATE as its chat template."""
    out = tmp_path / "model"
    out.mkdir()
    for f in STORIES.iterdir():
        if f.name != "tokenizer_config.json":
            (out / f.name).symlink_to(f)
    config = json.loads((STORIES / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return out


@needs_stories
def test_chat_refuses_a_model_whose_chat_template_does_not_compile_naming_file_and_line(tmp_path):
    model = stories_with_template(tmp_path, BROKEN_TEMPLATE)
    result = minillm("chat", str(model), "--device", "cpu", "--max-tokens", "4", stdin="hello\n")
    assert result.returncode == 1, result
    assert "Traceback" not in result.stderr and ">>>" not in result.stdout
    last = result.stderr.strip().splitlines()[-1]
    assert last == (f"minillm: error: the chat template of {model} does not compile: TemplateSyntaxError at line 2 "
                    f"of {model / 'tokenizer_config.json'} field 'chat_template': expected token 'end of statement "
                    "block', got '%'; chat renders every message with the model's chat template: fix it, or "
                    "give one with --chat-template")


@needs_stories
def test_chat_with_a_chat_template_flag_over_a_broken_one_chats(tmp_path):
    model = stories_with_template(tmp_path, BROKEN_TEMPLATE)
    template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    result = minillm("chat", str(model), "--device", "cpu", "--max-tokens", "4", "--chat-template", template,
                     stdin="hello\n")
    assert result.returncode == 0, result
    assert "error" not in result.stdout


@needs_stories
def test_chat_with_a_model_without_a_chat_template_keeps_its_plain_text_fallback():
    assert "chat_template" not in json.loads((STORIES / "tokenizer_config.json").read_text())
    result = minillm("chat", str(STORIES), "--device", "cpu", "--max-tokens", "4", stdin="hello\n")
    assert result.returncode == 0, result
    assert "error" not in result.stdout and "error" not in result.stderr

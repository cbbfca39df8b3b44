"""`prefixlab run` with a transformers tokenizer: chat `messages` through its chat template, `text` as the tokenizer
encodes it, the --model folder's own tokenizer by default; and what it refuses."""

import hashlib
import json

import pytest
import torch
from hf_models import config as tiny_config
from test_fleet_run import read_out

from prefixlab.cli import main
from prefixlab.errors import InvalidInputError
from prefixlab.fleet import loading, serve
from prefixlab.fleet.prompts import read_prompts
from prefixlab.fleet.tokenizer import PromptTokenizer, prompt_tokenizer

WORDS = ["[UNK]", "<s>", "</s>", "system", "user", "assistant", ":", *"you are a librarian the library opens at nine "
         "closes late on sunday and monday ? when what time".split()]
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}assistant :{% endif %}")
SYSTEM = {"role": "system", "content": "you are a librarian the library opens at nine on sunday and closes late on "
          "monday you are a librarian"}


def tokenizer_folder(folder, chat_template: str | None = TEMPLATE):
    """A word-level transformers tokenizer (ids 3 and up, a BOS it adds to text) saved in `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({w: i + 3 for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 4)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="[UNK]")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(folder))
    return folder


def chats(path, questions):
    path.write_text("".join(json.dumps({"id": k, "messages": [SYSTEM, {"role": "user", "content": q}]}) + "\n"
                            for k, q in enumerate(questions)))
    return path


def test_chat_prompts_reuse_their_system_message_exactly(capsys, tmp_path):
    tiny_config("qwen3_5").to_json_file(tmp_path / "config.json")
    folder = tokenizer_folder(tmp_path / "tokenizer")
    prompts = chats(tmp_path / "chat.jsonl", ["when the library opens ?", "what time the library closes ?",
                                              "the library opens on monday ?"])
    out = tmp_path / "out.jsonl"
    code = main(["run", prompts, "--model", tmp_path / "config.json", "--tokenizer", folder, "--out", out,
                 "--max-new-tokens", "3", "--json"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and summary["reused_tokens"] > 0
    hf = PromptTokenizer(folder).hf
    model = loading.load_model(str(tmp_path / "config.json"))
    for record, line in zip(read_out(out), prompts.read_text().splitlines(), strict=True):
        ids = hf.apply_chat_template(json.loads(line)["messages"], add_generation_prompt=True)["input_ids"]
        assert record["prompt_tokens"] == len(ids) and ids[-2:] == [hf.convert_tokens_to_ids("assistant"), 9]
        with torch.inference_mode():
            assert record["output_ids"] == serve.generate_uncached(model, torch.tensor(ids).numpy(), 3)
        assert record["text"] == hf.decode(record["output_ids"], skip_special_tokens=True)


def test_the_model_folders_own_tokenizer_is_used_by_default(capsys, tmp_path):
    """A model folder with its tokenizer: text prompts run without --tokenizer, encoded as `tokenizer(text)` (its BOS
    first), and outputs carry their decoded text."""
    folder = tmp_path / "model"
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(tiny_config("qwen3_5")).save_pretrained(str(folder))
    tokenizer_folder(folder)
    prompts = tmp_path / "text.jsonl"
    prompts.write_text("".join(json.dumps({"id": k, "text": f"the library opens at nine on {day} ?"}) + "\n"
                               for k, day in enumerate(["sunday", "monday"])))
    out = tmp_path / "out.jsonl"
    assert main(["run", prompts, "--model", folder, "--out", out, "--max-new-tokens", "2"]) == 0
    capsys.readouterr()
    records = read_out(out)
    assert [r["prompt_tokens"] for r in records] == [9, 9] and all("text" in r for r in records)
    assert [int(p.tokens[0]) for p in read_prompts(prompts, PromptTokenizer(folder))] == [4, 4]  # (its BOS)


def test_what_chat_prompts_need_is_said_per_line(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    json_file = tmp_path / "tokenizer.json"
    plain = Tokenizer(models.WordLevel({w: i + 3 for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    plain.pre_tokenizer = pre_tokenizers.Whitespace()
    plain.save(str(json_file))
    prompts = chats(tmp_path / "chat.jsonl", ["when the library opens ?"])
    with pytest.raises(InvalidInputError, match=r"chat.jsonl:1: 'messages' need a chat template: .* tokenizers JSON"):
        read_prompts(prompts, PromptTokenizer(json_file))
    with pytest.raises(InvalidInputError, match=r"chat.jsonl:1: 'messages' need a chat template and the tokenizer"):
        read_prompts(prompts, PromptTokenizer(tokenizer_folder(tmp_path / "no_template", chat_template=None)))
    with pytest.raises(InvalidInputError, match=r"chat.jsonl:1: a 'messages' prompt needs a tokenizer"):
        read_prompts(prompts)
    folder = tokenizer_folder(tmp_path / "tokenizer")
    bad = tmp_path / "bad.jsonl"
    for line, message in [({"id": 1, "messages": []}, "'messages' must be a non-empty list"),
                          ({"id": 1, "messages": [{"role": "user"}]}, "'messages' must be a non-empty list"),
                          ({"id": 1, "messages": "hi"}, "'messages' must be a non-empty list"),
                          ({"id": 1, "messages": [SYSTEM], "text": "hi"}, "give exactly one of 'text', 'messages'")]:
        bad.write_text(json.dumps(line) + "\n")
        with pytest.raises(InvalidInputError, match=rf"bad.jsonl:1: {message}"):
            read_prompts(bad, PromptTokenizer(folder))
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidInputError, match="holds no tokenizer files"):
        PromptTokenizer(tmp_path / "empty")


def test_a_chat_the_template_refuses_is_a_bad_line(tmp_path, capsys):
    """Chat templates refuse chats with raise_exception (roles that do not alternate): a malformed line, skippable."""
    folder = tokenizer_folder(tmp_path / "tokenizer", chat_template=(
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('roles must alternate user/assistant') }}"
        "{% endif %}" + TEMPLATE))
    prompts = tmp_path / "chat.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in [
        {"id": 1, "messages": [{"role": "user", "content": "when the library opens ?"}]},
        {"id": 2, "messages": [SYSTEM, {"role": "user", "content": "when the library opens ?"}]}]))
    with pytest.raises(InvalidInputError, match=r"chat.jsonl:2: the chat template .* refused these messages: roles"):
        read_prompts(prompts, PromptTokenizer(folder))
    assert [p.id for p in read_prompts(prompts, PromptTokenizer(folder), on_error="skip")] == [1]
    assert "skipped" in capsys.readouterr().err


def test_a_tokenizer_json_the_tokenizers_library_cannot_read(tmp_path, capsys):
    """(e.g. saved by a newer tokenizers): --tokenizer names it; in the --model folder it is only a note."""
    folder = tokenizer_folder(tmp_path / "model")
    saved = json.loads((folder / "tokenizer.json").read_text())
    saved["model"]["type"] = "FromTheFuture"
    (folder / "tokenizer.json").write_text(json.dumps(saved))
    with pytest.raises(InvalidInputError, match="not a transformers tokenizer folder"):
        PromptTokenizer(folder)
    assert prompt_tokenizer(None, str(folder)) is None
    assert "the model folder's tokenizer is not used" in capsys.readouterr().err


def _written_before_tokenizer_digests(out, model_digest):
    """OUT's records as a run before the --model folder's tokenizer was used by default wrote them: no tokenizer, so
    no decoded `text`, and the model's digest alone."""
    records = [{k: v for k, v in r.items() if k != "text"} | {"model": model_digest} for r in read_out(out)]
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    return out.read_bytes()


def test_records_written_before_the_tokenizer_digests_are_resumed(capsys, tmp_path):
    """A rerun refused the records of an OUT written before the output digest included the tokenizer ("made from
    another prompt, max_new_tokens or model (or --tokenizer)"), although they are this run's: a --model folder's
    tokenizer was then not used (records of input_ids prompts, no text: the same ids), a --tokenizer JSON file was
    digested by its bytes alone."""
    folder = tmp_path / "model"
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(tiny_config("qwen3_5")).save_pretrained(str(folder))
    tokenizer_folder(folder)
    model_digest = loading.model_digest(loading.load_model(str(folder)))
    prompts = tmp_path / "ids.jsonl"
    prompts.write_text("".join(json.dumps({"id": k, "input_ids": [5 + k, 6, 7, 8, 9]}) + "\n" for k in range(3)))
    out = tmp_path / "out.jsonl"
    command = ["run", prompts, "--model", folder, "--out", out, "--max-new-tokens", "2", "--json"]
    assert main(command) == 0
    capsys.readouterr()
    before = _written_before_tokenizer_digests(out, model_digest)
    assert main(command) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["resumed"] == 3 and summary["requests"] == 0 and out.read_bytes() == before

    json_file = folder / "tokenizer.json"
    texts = tmp_path / "text.jsonl"
    texts.write_text(json.dumps({"id": 0, "text": "the library opens at nine"}) + "\n")
    command = ["run", texts, "--model", folder, "--tokenizer", json_file, "--out", out, "--max-new-tokens", "2",
               "--json"]
    out.unlink()
    assert main(command) == 0
    capsys.readouterr()
    old_digest = hashlib.sha256(model_digest.encode() + json_file.read_bytes()).hexdigest()[:16]
    out.write_text("".join(json.dumps(r | {"model": old_digest}) + "\n" for r in read_out(out)))
    assert main(command) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["resumed"] == 1

"""Chat templates and the tokenizer settings a checkpoint declares: rendering equal to transformers'
apply_chat_template on the same tokenizer folder, the end-of-turn token as a stop id, BOS as the checkpoint asks
(never twice), clear errors, and all of it surviving `causal-lm convert` into a workdir and back out.
"""

import json
import os

import pytest  # noqa: E402

transformers = pytest.importorskip("transformers", reason="the interop extra is not installed")
from chat_tokenizers import CHATML, CHATML_SPECIALS, LLAMA3, LLAMA3_SPECIALS, train_bpe  # noqa: E402
from tokenizers import processors  # noqa: E402

from causal_lm import ChatTemplateError, apply_chat_template  # noqa: E402
from causal_lm.data.tokenizer import load_tokenizer, tokenizer_from_dict  # noqa: E402
from causal_lm.interop.hf import read_hf_tokenizer  # noqa: E402

# A template that passes message content through tojson (which must not HTML-escape), reads a caller variable, and
# is laid out on indented lines without `-`: it renders as transformers does only with trim_blocks and lstrip_blocks.
TOJSON = """{% for m in messages %}
    {% if m['role'] == 'system' %}
[{{ m['content'] | trim }}]
    {% else %}
{{ m['role'] }}: {{ m['content'] | tojson }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
assistant:{% endif %}{% if note is defined %} ({{ note }}){% endif %}"""

KINDS = {
    # name: (special tokens at ids 0.., bos, eos, template, where the template is stored)
    "chatml": (CHATML_SPECIALS, "<|im_start|>", "<|im_end|>", CHATML, "tokenizer_config.json"),
    "llama3": (LLAMA3_SPECIALS, "<|begin_of_text|>", "<|end_of_text|>", LLAMA3, "chat_template.jinja"),
    "tojson": (CHATML_SPECIALS, "<|im_start|>", "<|endoftext|>", TOJSON, "tokenizer_config.json"),
}

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "  You answer briefly.  "},
        {"role": "user", "content": 'Hi <b>there</b> & "friends", café 中文'},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Numbers: 12345."},
    ],
]


def make_folder(path, kind, *, post_bos=False, add_bos_token=None, generation_eos=None):
    """A Hugging Face tokenizer folder: tokenizer.json, tokenizer_config.json (+ chat_template.jinja)."""
    specials, bos, eos, template, where = KINDS[kind]
    tok = train_bpe(specials)
    if post_bos:  # BOS added by tokenizer.json's post-processor, as Llama 3's and Gemma's files do
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    tc = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": {"__type": "AddedToken", "content": eos},
    }
    if add_bos_token is not None:
        tc["add_bos_token"] = add_bos_token
    if where == "tokenizer_config.json":
        tc["chat_template"] = template
    else:
        with open(os.path.join(path, where), "w") as f:
            f.write(template)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f)
    if generation_eos is not None:
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": generation_eos}, f)
    hf = {"bos_token_id": tok.token_to_id(bos), "eos_token_id": tok.token_to_id(eos)}
    return str(path), hf


@pytest.fixture(scope="module", params=list(KINDS))
def folder(request, tmp_path_factory):
    path, hf = make_folder(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, path, read_hf_tokenizer(path, hf), transformers.AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_rendering_equals_transformers(folder, chat, gen):
    """Text and ids equal transformers' apply_chat_template on the same folder (template from
    tokenizer_config.json or chat_template.jinja; special tokens, whitespace control, namespace, loop controls,
    tojson and caller variables)."""
    kind, _, ours, ref = folder
    msgs = CHATS[chat]
    extra = {"note": "v1 <ok>"} if kind == "tojson" else {}
    text = apply_chat_template(ours, msgs, add_generation_prompt=gen, **extra)
    assert text == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, **extra)
    ids = apply_chat_template(ours, msgs, add_generation_prompt=gen, tokenize=True, **extra)
    assert ids == ref.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen, return_dict=False, **extra)
    if kind == "llama3":
        assert text.startswith("<|begin_of_text|>")  # bos_token reached the template


def test_end_of_turn_tokens_are_stop_ids(tmp_path):
    """The token after an assistant message is a stop id by default (ChatML's <|im_end|>, Llama 3's <|eot_id|>),
    as is every EOS id of generation_config.json; a template whose turns end in plain text adds none."""
    path, hf = make_folder(tmp_path / "chatml", "chatml")
    tok = read_hf_tokenizer(path, hf)
    assert tok.stop_ids == (2,)  # <|im_end|>: EOS and end of turn at once
    path, hf = make_folder(tmp_path / "llama3", "llama3", generation_eos=[1, 4])
    tok = read_hf_tokenizer(path, hf)
    assert tok.eos_id == 1 and set(tok.stop_ids) == {1, 4}  # <|end_of_text|>, <|eot_id|>
    path, hf = make_folder(tmp_path / "plain", "tojson")
    assert read_hf_tokenizer(path, hf).stop_ids == (0,)
    path, hf = make_folder(tmp_path / "plain-gen", "tojson", generation_eos=[0, 2])
    assert read_hf_tokenizer(path, hf).stop_ids == (0, 2)  # the second EOS id of generation_config.json


def test_bos_as_the_checkpoint_asks(tmp_path):
    """BOS from tokenizer.json's post-processor is prepended once, as transformers prepends it; none without;
    add_bos_token=true in tokenizer_config.json also prepends it (transformers 5 leaves that flag to the
    post-processor when tokenizer.json exists; llama.cpp and transformers 4 honour it), and a text that already
    starts with BOS (a rendered Llama 3 chat) keeps one."""
    text = "The lazy dog"
    for post, flag, expect in ((True, None, True), (False, None, False), (True, False, True)):
        path, hf = make_folder(tmp_path / f"{post}-{flag}", "llama3", post_bos=post, add_bos_token=flag)
        ours, ref = read_hf_tokenizer(path, hf), transformers.AutoTokenizer.from_pretrained(path)
        assert ours.add_bos is expect
        assert ours.encode_prompt(text) == ref(text)["input_ids"]
        assert ours.encode(text) == ref(text, add_special_tokens=False)["input_ids"]  # encode adds nothing
    path, hf = make_folder(tmp_path / "flag", "llama3", add_bos_token=True)
    ours = read_hf_tokenizer(path, hf)
    assert ours.add_bos and ours.encode_prompt(text) == [0] + ours.encode(text)
    chat = apply_chat_template(ours, CHATS[0])
    assert ours.encode_prompt(chat)[:2] == [0, 2]  # <|begin_of_text|> once, then <|start_header_id|>


def test_errors_are_clear(tmp_path, folder):
    _, _, ours, _ = folder
    path, hf = make_folder(tmp_path / "none", "chatml")
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        tc = json.load(f)
    del tc["chat_template"]
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f)
    bare = read_hf_tokenizer(path, hf)
    assert bare.chat_template is None
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        apply_chat_template(bare, CHATS[0])
    with pytest.raises(ChatTemplateError, match="messages must be a list"):
        apply_chat_template(ours, "hello")
    with pytest.raises(ChatTemplateError, match="messages is empty"):
        apply_chat_template(ours, [])
    llama3 = read_hf_tokenizer(*make_folder(tmp_path / "l3", "llama3"))
    with pytest.raises(ChatTemplateError, match="Only user, assistant and system roles are supported, got tool"):
        apply_chat_template(llama3, [{"role": "tool", "content": "42"}])
    bare.chat_template = "{% for m in messages %}{{ m.content }"
    with pytest.raises(ChatTemplateError, match="not valid Jinja"):
        apply_chat_template(bare, CHATS[0])


def test_settings_survive_save_and_restore(tmp_path):
    path, hf = make_folder(tmp_path / "src", "llama3", post_bos=True, generation_eos=[1, 4])
    tok = read_hf_tokenizer(path, hf)
    for again in (tokenizer_from_dict(json.loads(json.dumps(tok.to_dict()))), _saved(tok, tmp_path / "saved")):
        assert again.to_dict() == tok.to_dict()
        assert (again.add_bos, again.stop_ids, again.chat_template) == (True, (1, 4), LLAMA3)


def _saved(tok, directory):
    tok.save(str(directory))
    return load_tokenizer(str(directory))


@pytest.mark.slow
def test_convert_from_hf_keeps_settings_and_to_hf_writes_them(tmp_path, capsys):
    """convert --from-hf into a workdir keeps the template, BOS rule and stop ids; convert --to-hf writes the
    template back (chat_template.jinja) where transformers finds it, and generate --chat runs on the workdir."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("causal_lm.train.checkpoint")
    from causal_lm.cli import main
    from causal_lm.train.checkpoint import load_for_inference

    src, hf = make_folder(tmp_path / "hf", "llama3", post_bos=True, generation_eos=[1, 4])
    tok = read_hf_tokenizer(src, hf)
    config = transformers.LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(src)
    with open(os.path.join(src, "generation_config.json"), "w") as f:  # save_pretrained wrote its own
        json.dump({"eos_token_id": [1, 4]}, f)
    wd, back = str(tmp_path / "wd"), str(tmp_path / "back")
    assert main(["convert", "--from-hf", src, "--workdir", wd]) == 0
    assert "--chat" in capsys.readouterr().out
    saved = load_for_inference(wd)[1]
    assert (saved.add_bos, saved.stop_ids, saved.chat_template) == (True, (1, 4), LLAMA3)
    assert main(["generate", "--workdir", wd, "--chat", "Hi", "--max-new-tokens", "4", "--no-stream"]) == 0
    assert "tokens/s" in capsys.readouterr().err
    assert main(["convert", "--to-hf", wd, "--out", back]) == 0
    ref = transformers.AutoTokenizer.from_pretrained(back)
    for msgs in CHATS:
        assert apply_chat_template(saved, msgs) == ref.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=True
        )


def test_cli_chat_errors_are_one_line(capsys):
    """--chat misuse is one `error:` line before any model is built."""
    from causal_lm.cli import main

    for argv, match in (
        (["generate", "--chat", "hi"], "--chat needs --workdir"),
        (["generate", "--workdir", "x", "--chat", "hi", "--prompt", "The "], "exclude each other"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "error:" in err[0] and match in err[0], err

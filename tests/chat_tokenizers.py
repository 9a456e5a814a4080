"""Small tokenizers and chat templates shared by test_gguf.py and test_chat_template.py.

The templates follow the layouts of real instruct models (ChatML as SmolLM2 and Qwen2 use it, Llama 3's headers);
they are written here, not copied, and are exercised against transformers' own rendering.
"""

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Language models predict the next token, one at a time.",
    "What is the capital of France? Paris is the capital of France.",
    "Numbers like 12345 and 2024 appear in text; so do symbols: #, $, %.",
    "Ein kleiner Text, und 中文 auch. Émigré naïve café.",
] * 8

# ChatML: a default system message when the conversation has none, then <|im_start|>role\ncontent<|im_end|>\n.
CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Llama 3's layout: BOS written by the template, role headers, <|eot_id|> ending each turn; whitespace control
# (trim_blocks / lstrip_blocks, `-`), a namespace, `raise_exception` and loop controls, as real templates use.
LLAMA3 = """{{- bos_token }}
{%- set ns = namespace(system=none) %}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}
        {%- set ns.system = message['content'] %}
        {%- continue %}
    {%- endif %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('Only user, assistant and system roles are supported, got ' + message['role']) }}
    {%- endif %}
    {%- if loop.first and ns.system is not none %}
        {{- '<|start_header_id|>system<|end_header_id|>\n\n' + ns.system | trim + '<|eot_id|>' }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def train_bpe(specials, vocab_size: int = 300, *, pre_tokenizer=None) -> Tokenizer:
    """A byte-level BPE trained on CORPUS, with `specials` at ids 0, 1, ... (special added tokens)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[AddedToken(s, special=True, normalized=False) for s in specials],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def bpe_vocab_and_merges(tok: Tokenizer) -> tuple[list[str], list[str]]:
    """The tokens in id order and the merges as "a b" strings: what a GGUF file stores."""
    import json

    model = json.loads(tok.to_str())["model"]
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges

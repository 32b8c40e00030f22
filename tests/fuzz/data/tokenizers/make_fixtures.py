#!/usr/bin/env python3
# Writes the two generated tokenizer fixtures of this folder, sentencepiece/
# and normalized/ (tiny/ is `pdserve make-model --preset tiny`'s tokenizer):
# small BPE vocabularies learned from a fixed text, in the tokenizer.json
# layouts of Llama 2 and of a normalizing Metaspace tokenizer.
# Run from this folder: python3 make_fixtures.py
import json, collections
TEXT = ("The quick brown fox jumps over the lazy dog. A serving system turns prompts into tokens, "
        "and tokens into text. The router sends each request to a worker that already holds the "
        "prefix of its prompt in the cache. Hello, world! How are you today? 12345 67890 "
        "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber stra\u00dfe \u00bfqu\u00e9? \u3053\u3093\u306b\u3061\u306f \u4f60\u597d")
META = "\u2581"

def learn(words, symbols, n):
    words = collections.Counter(tuple(w) for w in words)
    vocab = list(symbols)
    merges = []
    for _ in range(n):
        pairs = collections.Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]): pairs[(a, b)] += c
        if not pairs: break
        (a, b), c = max(pairs.items(), key=lambda kv: (kv[1], [-ord(ch) for ch in kv[0][0] + kv[0][1]]))
        if c < 2: break
        merges.append([a, b]); vocab.append(a + b)
        new = collections.Counter()
        for w, cnt in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b: out.append(a + b); i += 2
                else: out.append(w[i]); i += 1
            new[tuple(out)] += cnt
        words = new
    return vocab, merges

# Llama 2 style: Prepend/Replace normalizer, byte fallback, no pre-tokenizer.
norm = META + TEXT.replace(" ", META)
words = [META + w for w in TEXT.split(" ")]
chars = sorted(set("".join(words)) - {"\u3053", "\u3093", "\u306b", "\u3061", "\u306f", "\u4f60", "\u597d"})
vocab_list, merges = learn(words, [META] + [c for c in chars if c != META], 120)
vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
for b in range(256): vocab["<0x%02X>" % b] = 3 + b
for t in vocab_list:
    if t not in vocab: vocab[t] = len(vocab)
sp = {
  "version": "1.0", "truncation": None, "padding": None,
  "added_tokens": [
    {"id": 0, "content": "<unk>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True},
    {"id": 1, "content": "<s>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True},
    {"id": 2, "content": "</s>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}],
  "normalizer": {"type": "Sequence", "normalizers": [
    {"type": "Prepend", "prepend": META},
    {"type": "Replace", "pattern": {"String": " "}, "content": META}]},
  "pre_tokenizer": None,
  "post_processor": {"type": "TemplateProcessing",
    "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
    "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
             {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
    "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
  "decoder": {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": META}, "content": " "},
    {"type": "ByteFallback"}, {"type": "Fuse"},
    {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
  "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
            "vocab": vocab, "merges": merges}}
json.dump(sp, open("sentencepiece/tokenizer.json", "w"), ensure_ascii=False, indent=1)

# Normalizing: NFKC + Lowercase, digits split, Metaspace pre-tokenizer and
# decoder, <unk> without byte fallback, ignore_merges, added tokens with the
# lstrip / rstrip / single_word rules, BOS and EOS.
low = TEXT.lower()
words = [META + w for w in low.replace("1", " 1 ").split(" ") if w]
chars = sorted(set("".join(words)))
vocab_list, merges = learn(words, chars, 80)
vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
for t in vocab_list + [str(d) for d in range(10)]:
    if t not in vocab: vocab[t] = len(vocab)
base = len(vocab)
added = [
  {"id": 0, "content": "<unk>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True},
  {"id": 1, "content": "<s>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True},
  {"id": 2, "content": "</s>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True},
  {"id": base, "content": "<|user|>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True},
  {"id": base + 1, "content": "[L]", "single_word": False, "lstrip": True, "rstrip": False, "normalized": False, "special": False},
  {"id": base + 2, "content": "[R]", "single_word": False, "lstrip": False, "rstrip": True, "normalized": False, "special": False},
  {"id": base + 3, "content": "word", "single_word": True, "lstrip": False, "rstrip": False, "normalized": True, "special": False}]
nm = {
  "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
  "normalizer": {"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Lowercase"}]},
  "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
    {"type": "Digits", "individual_digits": True},
    {"type": "Metaspace", "replacement": META, "prepend_scheme": "always", "split": True}]},
  "post_processor": {"type": "TemplateProcessing",
    "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
               {"SpecialToken": {"id": "</s>", "type_id": 0}}],
    "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
    "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]},
                       "</s>": {"id": "</s>", "ids": [2], "tokens": ["</s>"]}}},
  "decoder": {"type": "Metaspace", "replacement": META, "prepend_scheme": "always", "split": True},
  "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": False, "ignore_merges": True,
            "vocab": vocab, "merges": merges}}
json.dump(nm, open("normalized/tokenizer.json", "w"), ensure_ascii=False, indent=1)

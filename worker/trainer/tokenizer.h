/* tokenizer.h — GPT-2's byte-level BPE tokenizer, read from the two files that OpenAI's GPT-2,
 * Megatron-LM (GPT2BPETokenizer) and Hugging Face (GPT2Tokenizer) all use:
 *   vocab.json   {"token": id, ...}: each token's bytes spelled with GPT-2's byte-to-character
 *                map (a space is "Ġ"), special tokens such as "<|endoftext|>" included;
 *   merges.txt   an optional "#version" line, then one merge "A B" a line, first merge first.
 *
 * Encoding (what OpenAI's encoder.py and tiktoken's encode_ordinary compute): the UTF-8 text is
 * split into pieces by GPT-2's pattern (contractions, runs of letters, of digits, of other
 * symbols, each with at most one leading space, and whitespace), each piece's bytes become
 * byte tokens, and the adjacent pair whose merge comes first in merges.txt is merged until no
 * pair has a merge. Special tokens written in the text are plain text there: a document
 * separator is an id the caller adds (dt_bpe_token_id(b, "<|endoftext|>")).
 *
 * The split runs on PCRE2 (JIT), with "\s" spelled out as Unicode's White_Space characters (as
 * tiktoken's Rust regex reads it); the files are read with json-c. Encoded pieces are cached:
 * natural text repeats its words, so most pieces cost one hash lookup. A dt_bpe_t is not
 * thread-safe (the cache and match data; decoding is read-only): each thread encodes with a
 * clone of its own, which shares the tables. */
#ifndef DT_TRAINER_TOKENIZER_H
#define DT_TRAINER_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

typedef struct dt_bpe dt_bpe_t;

/* Reads vocab.json and, unless merges_path is NULL (a tokenizer that only decodes), merges.txt.
 * On failure returns a DT_E* code with a one-line reason naming the file in err. */
int dt_bpe_create(dt_bpe_t **out, const char *vocab_path, const char *merges_path, char *err,
                  size_t errlen);
/* A tokenizer for another thread: its own cache, b's tables (destroy it before b). */
int dt_bpe_clone(const dt_bpe_t *b, dt_bpe_t **out);
void dt_bpe_destroy(dt_bpe_t *b);

/* One more than the largest id in vocab.json. */
int dt_bpe_vocab_size(const dt_bpe_t *b);

/* The id of a token spelled as in vocab.json ("<|endoftext|>"), or -1. */
int dt_bpe_token_id(const dt_bpe_t *b, const char *token);

/* Appends the tokens of text (len bytes of UTF-8) to ids[*n..], growing ids (capacity *cap)
 * with realloc. Text that is not UTF-8 returns DT_EINVAL with the offset of its first bad byte
 * in *bad (ids unchanged); DT_EINVAL too for a tokenizer without merges. */
int dt_bpe_encode(dt_bpe_t *b, const char *text, size_t len, int32_t **ids, size_t *n, size_t *cap,
                  size_t *bad);

/* The first position p >= from (or len, if none) where text can be cut in two whose encodings,
 * one after the other, are the whole text's: after a line break that has a printable ASCII
 * character on either side ("x\ny" -> "x\n" | "y"), where the split ends a piece whatever
 * comes before or after. Lets a long text be encoded in parallel pieces. */
size_t dt_bpe_next_cut(const char *text, size_t len, size_t from);

/* The bytes token id stands for (*len of them), or NULL for an id vocab.json does not have. A
 * token may end inside a UTF-8 character that the next one completes. */
const uint8_t *dt_bpe_decode(const dt_bpe_t *b, int id, size_t *len);

#endif

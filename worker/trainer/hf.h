/* hf.h — GPT-2 in Hugging Face's layout: a directory holding config.json and
 * model.safetensors, what transformers' GPT2LMHeadModel.save_pretrained writes and
 * from_pretrained reads (the hub's "gpt2", "gpt2-medium", ... are such directories).
 *
 * safetensors: an 8-byte little-endian header size, a JSON header naming each tensor's dtype,
 * shape and byte range, then the tensors' bytes. GPT-2's tensors are wte, wpe, ln_f and per
 * layer h.<l>.{ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj}, with or without
 * the "transformer." prefix; the LM head is tied to wte. Its linear layers are Conv1D, stored
 * (in, out): the transposes of llm.c's (out, in) matrices. The weights go in and out as one
 * flat fp32 buffer in llm.c's layout (DT_GPT2_TENSORS: wte padded to padded_vocab rows, which
 * the Hugging Face file does not hold). Reading takes F32, F16 and BF16 tensors; writing
 * writes F32. Both read and write the headers through json-c. */
#ifndef DT_TRAINER_HF_H
#define DT_TRAINER_HF_H

#include <stddef.h>

#include "gpt2.h"

/* Reads dir/config.json and dir/model.safetensors: the config (padded_vocab as distrain
 * pads it) and *params (dt_llmc_num_params floats, malloc'ed; the padded rows zero). Errors name
 * the file and the tensor or key at fault (one line in err). */
int dt_hf_read(const char *dir, dt_gpt2_config_t *cfg, float **params, char *err, size_t errlen);

/* Reads only dir/config.json's model (what --init hf:DIR checks the flags against). */
int dt_hf_read_config(const char *dir, dt_gpt2_config_t *cfg, char *err, size_t errlen);

/* Loads dir's weights into a model created with dir's config (this rank's part of them). */
int dt_hf_load(dt_gpt2_t *m, const char *dir, char *err, size_t errlen);

/* Writes dir/config.json and dir/model.safetensors (each atomically; dir is created) from
 * params in llm.c's layout. */
int dt_hf_write(const char *dir, const dt_gpt2_config_t *cfg, const float *params, char *err,
                size_t errlen);

#endif

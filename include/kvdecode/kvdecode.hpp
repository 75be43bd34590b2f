// kvdecode: header-only KV-cached decoding of Llama-style transformers. Include this one header.
#pragma once

#include "kvdecode/activations.hpp"
#include "kvdecode/aligned_buffer.hpp"
#include "kvdecode/attention.hpp"
#include "kvdecode/contiguous_store.hpp"
#include "kvdecode/error.hpp"
#include "kvdecode/generate.hpp"
#include "kvdecode/io/checkpoint.hpp"
#include "kvdecode/kv_store.hpp"
#include "kvdecode/model.hpp"
#include "kvdecode/model_config.hpp"
#include "kvdecode/reference.hpp"
#include "kvdecode/rope.hpp"
#include "kvdecode/sampler.hpp"
#include "kvdecode/tokenizer.hpp"
#include "kvdecode/weights.hpp"
#include "kvdecode/work_counters.hpp"

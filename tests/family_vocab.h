// The real Llama-3 and Qwen2 vocabularies of ../shared/models/families (vocab-only GGUFs, xz
// compressed) for the tests that tokenize with them.
#pragma once

#include <lzma.h>

#include <cstdint>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "locks/gguf.h"
#include "locks/tokenizer.h"
#include "test_paths.h"

namespace locks {

inline std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

inline std::vector<uint8_t> xz_decompress(const std::vector<uint8_t>& in) {
  lzma_stream strm = LZMA_STREAM_INIT;
  if (lzma_stream_decoder(&strm, UINT64_MAX, 0) != LZMA_OK) throw std::runtime_error("xz decoder");
  std::vector<uint8_t> out(size_t(1) << 20);
  strm.next_in = in.data();
  strm.avail_in = in.size();
  lzma_ret ret = LZMA_OK;
  size_t used = 0;
  while (ret == LZMA_OK) {
    if (used == out.size()) out.resize(out.size() * 2);
    strm.next_out = out.data() + used;
    strm.avail_out = out.size() - used;
    ret = lzma_code(&strm, LZMA_FINISH);
    used = out.size() - strm.avail_out;
  }
  lzma_end(&strm);
  if (ret != LZMA_STREAM_END) throw std::runtime_error("xz data corrupt");
  out.resize(used);
  return out;
}

// The vocabularies take ~1 s to load: once per process.
inline const Tokenizer& family_vocab(const std::string& pre) {
  static std::map<std::string, std::unique_ptr<Tokenizer>> cache;
  auto& slot = cache[pre];
  if (!slot) {
    const std::string path = test::shared_path("models/families/vocab-" + pre + ".gguf.xz");
    const GgufFile f = GgufFile::from_bytes(xz_decompress(read_bytes(path)), path);
    slot = std::make_unique<Tokenizer>(Tokenizer::from_gguf(f));
  }
  return *slot;
}

}  // namespace locks

#include "locks/text_corpus.h"

#include <lzma.h>

#include <algorithm>
#include <stdexcept>

#include <fmt/format.h>

#include "locks/read_input.h"

namespace locks {

namespace {

// Far above any held-out corpus (the shipped one is 10 MB); bounds a hostile or endless input,
// compressed or not.
constexpr size_t kMaxCorpusBytes = size_t(256) << 20;

std::string xz_decompress(const std::string& in, const std::string& path) {
  lzma_stream strm = LZMA_STREAM_INIT;
  if (lzma_stream_decoder(&strm, UINT64_MAX, LZMA_CONCATENATED) != LZMA_OK)
    throw std::runtime_error(fmt::format("'{}': cannot initialise the xz decoder", path));
  std::string out;
  std::vector<uint8_t> buf(1 << 20);
  strm.next_in = reinterpret_cast<const uint8_t*>(in.data());
  strm.avail_in = in.size();
  lzma_ret ret = LZMA_OK;
  while (ret == LZMA_OK) {
    strm.next_out = buf.data();
    strm.avail_out = buf.size();
    ret = lzma_code(&strm, LZMA_FINISH);
    out.append(reinterpret_cast<const char*>(buf.data()), buf.size() - strm.avail_out);
    if (out.size() > kMaxCorpusBytes) {
      lzma_end(&strm);
      throw std::runtime_error(fmt::format("'{}': decompresses to more than {} MiB", path, kMaxCorpusBytes >> 20));
    }
  }
  lzma_end(&strm);
  if (ret != LZMA_STREAM_END) throw std::runtime_error(fmt::format("'{}': xz data is corrupt or truncated", path));
  return out;
}

}  // namespace

std::vector<std::string> load_documents(const std::string& path) {
  std::string data = read_input(path, kMaxCorpusBytes, "text corpus");
  // xz by its magic bytes (a file's name may say otherwise), then text only: a NUL byte means binary.
  static constexpr char kXzMagic[6] = {'\xFD', '7', 'z', 'X', 'Z', '\0'};
  const bool named_xz = path.size() > 3 && path.compare(path.size() - 3, 3, ".xz") == 0;
  if (data.size() >= 6 && std::equal(kXzMagic, kXzMagic + 6, data.begin()))
    data = xz_decompress(data, path);
  else if (named_xz)
    throw std::runtime_error(fmt::format("'{}': named .xz but not xz data", path));
  require_text(data, path, "text corpus");
  std::vector<std::string> docs;
  size_t start = 0;
  while (start <= data.size()) {
    size_t end = data.find('\x1e', start);
    if (end == std::string::npos) end = data.size();
    if (end > start) docs.emplace_back(data.substr(start, end - start));
    start = end + 1;
  }
  if (docs.empty()) throw std::runtime_error(fmt::format("text corpus '{}' holds no documents", path));
  return docs;
}

}  // namespace locks

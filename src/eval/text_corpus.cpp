#include "locks/text_corpus.h"

#include <lzma.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>

#include <fmt/format.h>

namespace locks {

namespace {

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
  }
  lzma_end(&strm);
  if (ret != LZMA_STREAM_END) throw std::runtime_error(fmt::format("'{}': xz data is corrupt or truncated", path));
  return out;
}

}  // namespace

std::vector<std::string> load_documents(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) throw std::runtime_error(fmt::format("text corpus '{}' is a directory", path));
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error(fmt::format("cannot open text corpus '{}'", path));
  std::string data(std::istreambuf_iterator<char>(f), {});
  if (path.size() > 3 && path.compare(path.size() - 3, 3, ".xz") == 0) data = xz_decompress(data, path);
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

#include "locks/text_corpus.h"

#include <fmt/format.h>
#include <lzma.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <system_error>

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

std::string input_name(const std::string& path, const std::string& what) {
  return path == "-" ? what + " (standard input)" : what + " '" + path + "'";
}

std::string read_input(const std::string& path, size_t max_bytes, const std::string& what) {
  const std::string name = input_name(path, what);
  std::error_code ec;
  if (path != "-" && std::filesystem::is_directory(path, ec)) throw std::runtime_error(name + " is a directory");
  // C stdio for both: a standard input that cannot be read (closed, a directory) sets ferror, where
  // std::cin would only see an end of file and the input would pass for empty.
  errno = 0;
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(path == "-" ? nullptr : std::fopen(path.c_str(), "rb"),
                                                       &std::fclose);
  auto reason = [] { return errno != 0 ? std::string(": ") + std::strerror(errno) : std::string(); };
  if (path != "-" && !file) throw std::runtime_error("cannot open " + name + reason());
  std::FILE* in = path == "-" ? stdin : file.get();
  std::string text;
  char buf[1 << 16];
  errno = 0;
  for (size_t got; (got = std::fread(buf, 1, sizeof buf, in)) > 0;) {
    if (got > max_bytes - text.size())
      throw std::runtime_error(
          fmt::format("{} is larger than {} MiB (an endless input such as /dev/zero?)", name, max_bytes >> 20));
    text.append(buf, got);
  }
  if (std::ferror(in)) throw std::runtime_error("cannot read " + name + reason());
  return text;
}

void require_text(const std::string& data, const std::string& path, const std::string& what) {
  if (const size_t nul = data.find('\0'); nul != std::string::npos)
    throw std::runtime_error(
        fmt::format("{} holds a NUL byte at offset {} (binary data, not text)", input_name(path, what), nul));
}

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

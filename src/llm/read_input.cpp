#include "locks/read_input.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <system_error>

#include <fmt/format.h>

namespace locks {

std::string input_name(const std::string& path, const std::string& what) {
  return path == "-" ? what + " (standard input)" : what + " '" + path + "'";
}

std::string read_input(const std::string& path, size_t max_bytes, const std::string& what) {
  const std::string name = input_name(path, what);
  std::error_code ec;
  if (path != "-" && std::filesystem::is_directory(path, ec)) throw std::runtime_error(name + " is a directory");
  std::ifstream file;
  if (path != "-") {
    errno = 0;
    file.open(path, std::ios::binary);
    if (!file)
      throw std::runtime_error("cannot open " + name +
                               (errno != 0 ? std::string(": ") + std::strerror(errno) : std::string()));
  }
  std::istream& in = path == "-" ? std::cin : file;
  std::string text;
  char buf[1 << 16];
  while (in) {
    in.read(buf, sizeof buf);
    const size_t got = size_t(in.gcount());
    if (got > max_bytes - text.size())
      throw std::runtime_error(
          fmt::format("{} is larger than {} MiB (an endless input such as /dev/zero?)", name, max_bytes >> 20));
    text.append(buf, got);
  }
  if (in.bad()) throw std::runtime_error("cannot read " + name);
  return text;
}

void require_text(const std::string& data, const std::string& path, const std::string& what) {
  if (const size_t nul = data.find('\0'); nul != std::string::npos)
    throw std::runtime_error(
        fmt::format("{} holds a NUL byte at offset {} (binary data, not text)", input_name(path, what), nul));
}

}  // namespace locks

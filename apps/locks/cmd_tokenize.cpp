// `locks tokenize`: a text's token ids under a model's vocabulary, as llama.cpp's llama-tokenize
// prints them. Reads the GGUF metadata only (no weights are loaded), so a vocabulary-only GGUF works.
#include <fmt/format.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <stdexcept>

#include "commands.h"
#include "locks/gguf.h"
#include "locks/text_corpus.h"
#include "locks/tokenizer.h"

namespace locks::cli {

namespace {

struct TokenizeArgs {
  std::string model;
  std::string prompt;
  std::string prompt_file;
  bool prompt_given = false;
  bool ids = false;
  bool no_bos = false;
  bool special = false;
};

// As `locks run`'s prompt files.
constexpr size_t kMaxTextBytes = size_t(256) << 20;

// The GGUF reader takes GGUF only; an xz-compressed file (as ../shared ships vocabularies) gets a hint.
void refuse_xz(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return;  // (a FIFO would block here) GgufFile::open names it
  std::ifstream in(path, std::ios::binary);
  char magic[6] = {};
  if (in.read(magic, sizeof magic) && std::string_view(magic, 6) == std::string_view("\xFD"
                                                                                     "7zXZ\0",
                                                                                     6))
    throw std::runtime_error("GGUF '" + path + "' is xz-compressed: decompress it first (xz -dk)");
}

int run_tokenize(const TokenizeArgs& a) {
  if (a.prompt_given && !a.prompt_file.empty())
    throw CLI::ValidationError("--prompt", "--prompt and --prompt-file are mutually exclusive");
  if (!a.prompt_given && a.prompt_file.empty())
    throw CLI::ValidationError("--prompt", "give the text with -p TEXT or -f FILE");
  std::string text = a.prompt;
  if (!a.prompt_given) {
    text = read_input(a.prompt_file, kMaxTextBytes, "prompt file");
    require_text(text, a.prompt_file, "prompt file");
  }
  const std::string model_path = a.model.empty() ? default_model_path() : a.model;
  refuse_xz(model_path);
  const GgufFile gguf = GgufFile::open(model_path);
  const Tokenizer tok = Tokenizer::from_gguf(gguf);
  const std::vector<int32_t> ids = tok.encode(text, tok.add_bos() && !a.no_bos, a.special);
  if (a.ids) {
    std::string line = "[";
    for (size_t i = 0; i < ids.size(); ++i) line += (i ? ", " : "") + std::to_string(ids[i]);
    line += "]\n";
    std::fwrite(line.data(), 1, line.size(), stdout);
    return 0;
  }
  // One token a line: its id and its text (control tokens as stored, e.g. <|eot_id|>).
  for (const int32_t id : ids) {
    const std::string piece = tok.token_type(id) == Tokenizer::kControl ? tok.piece(id) : tok.token_to_piece(id);
    const std::string line = fmt::format("{:>6} -> '{}'\n", id, piece);
    std::fwrite(line.data(), 1, line.size(), stdout);
  }
  return 0;
}

}  // namespace

Runner add_tokenize(CLI::App& app) {
  auto a = std::make_shared<TokenizeArgs>();
  app.add_option("-m,--model", a->model,
                 "GGUF model or vocabulary-only GGUF; only its tokenizer.ggml.* keys are used "
                 "(default: models/locks-ref-a-q8_0.gguf)")
      ->check(non_empty_path());
  CLI::Option* prompt_opt = app.add_option("-p,--prompt", a->prompt, "text to tokenize");
  app.add_option("-f,--prompt-file", a->prompt_file, "file to tokenize, '-' for stdin")->check(non_empty_path());
  app.add_flag("--ids", a->ids, "print the ids only, as [1, 2, 3] on one line");
  app.add_flag("--no-bos", a->no_bos, "do not add BOS even where the vocabulary adds it");
  app.add_flag("--special", a->special,
               "control tokens written in the text (<|begin_of_text|>, <|im_start|>) become those tokens");
  return [a, prompt_opt] {
    a->prompt_given = prompt_opt->count() > 0;
    return run_tokenize(*a);
  };
}

}  // namespace locks::cli

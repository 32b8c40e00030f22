#include "common/structured/regex.h"
#include "common/utf8.h"

#include <memory>
#include <vector>

namespace pdserve::structured {
namespace {

struct Node {
  enum Kind { kSet, kSeq, kAlt, kRepeat, kStart, kEnd } kind = kSeq;
  CpSet set;
  std::vector<Node> kids;
  int min = 0, max = 0;  // kRepeat; max < 0: unbounded
};

constexpr int kMaxRepeatCount = 100000;

CpSet Digits() { return {{'0', '9'}}; }
CpSet Word() { return NormalizeSet({{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}}); }
CpSet Space() {
  return NormalizeSet({{'\t', '\r'},
                       {' ', ' '},
                       {0xA0, 0xA0},
                       {0x1680, 0x1680},
                       {0x2000, 0x200A},
                       {0x2028, 0x2029},
                       {0x202F, 0x202F},
                       {0x205F, 0x205F},
                       {0x3000, 0x3000},
                       {0xFEFF, 0xFEFF}});
}
CpSet AnyButLineTerminators() {
  return ComplementSet({{'\n', '\n'}, {'\r', '\r'}, {0x2028, 0x2029}});
}

class Parser {
 public:
  explicit Parser(std::u32string text) : s_(std::move(text)) {}

  StatusOr<Node> Parse() {
    auto n = Disjunction(0);
    if (!n.ok()) return n;
    if (i_ < s_.size()) return Error("unbalanced ')'");
    return n;
  }

 private:
  Status Error(const std::string& what) const {
    return Status::InvalidArgument("pattern: " + what + " at offset " + std::to_string(i_));
  }
  Status Unsupported(const std::string& what) const {
    return Status::InvalidArgument("pattern: " + what + " is not supported (offset " +
                                   std::to_string(i_) + ")");
  }
  bool At(char32_t c) const { return i_ < s_.size() && s_[i_] == c; }
  bool Eat(char32_t c) {
    if (!At(c)) return false;
    ++i_;
    return true;
  }

  StatusOr<Node> Disjunction(int depth) {
    if (depth > 200) return Error("groups nested too deep");
    Node alt;
    alt.kind = Node::kAlt;
    while (true) {
      auto seq = Alternative(depth);
      if (!seq.ok()) return seq;
      alt.kids.push_back(std::move(*seq));
      if (!Eat('|')) break;
    }
    if (alt.kids.size() == 1) return std::move(alt.kids[0]);
    return alt;
  }

  StatusOr<Node> Alternative(int depth) {
    Node seq;
    seq.kind = Node::kSeq;
    while (i_ < s_.size() && !At('|') && !At(')')) {
      if (Eat('^')) {
        seq.kids.push_back(Marker(Node::kStart));
        continue;
      }
      if (Eat('$')) {
        seq.kids.push_back(Marker(Node::kEnd));
        continue;
      }
      auto atom = Atom(depth);
      if (!atom.ok()) return atom;
      auto q = Quantified(std::move(*atom));
      if (!q.ok()) return q;
      seq.kids.push_back(std::move(*q));
    }
    return seq;
  }

  // {n}, {n,}, {n,m} at i_ (after '{'); false when it is not a quantifier
  // (then '{' is a literal, as Annex B allows).
  bool Braces(int* min, int* max) {
    size_t j = i_;
    auto number = [&](int* out) {
      const size_t from = j;
      int64_t v = 0;
      while (j < s_.size() && s_[j] >= '0' && s_[j] <= '9') {
        v = std::min<int64_t>(v * 10 + (s_[j] - '0'), kMaxRepeatCount + 1);
        ++j;
      }
      *out = static_cast<int>(v);
      return j > from;
    };
    if (!number(min)) return false;
    *max = *min;
    if (j < s_.size() && s_[j] == ',') {
      ++j;
      if (!number(max)) *max = -1;
    }
    if (j >= s_.size() || s_[j] != '}') return false;
    i_ = j + 1;
    return true;
  }

  StatusOr<Node> Quantified(Node atom) {
    int min = 0, max = 0;
    if (Eat('*')) {
      min = 0, max = -1;
    } else if (Eat('+')) {
      min = 1, max = -1;
    } else if (Eat('?')) {
      min = 0, max = 1;
    } else if (At('{')) {
      ++i_;
      if (!Braces(&min, &max)) {
        --i_;
        return atom;
      }
      if (max >= 0 && max < min) return Error("numbers out of order in {} quantifier");
      if (min > kMaxRepeatCount || max > kMaxRepeatCount)
        return Status::ResourceExhausted("pattern: repetition count over " +
                                         std::to_string(kMaxRepeatCount));
    } else {
      return atom;
    }
    Eat('?');  // lazy: the same language
    if (At('*') || At('+') || At('?')) return Error("nothing to repeat");
    if (At('{')) {
      const size_t save = i_++;
      int a, b;
      const bool quantifier = Braces(&a, &b);
      i_ = save;
      if (quantifier) return Error("nothing to repeat");
    }
    if (atom.kind == Node::kStart || atom.kind == Node::kEnd) return Error("nothing to repeat");
    Node r;
    r.kind = Node::kRepeat;
    r.min = min;
    r.max = max;
    r.kids.push_back(std::move(atom));
    return r;
  }

  StatusOr<Node> Atom(int depth) {
    const char32_t c = s_[i_];
    if (c == '(') {
      ++i_;
      if (Eat('?')) {
        if (At('=') || At('!')) return Unsupported("lookahead");
        if (At('<') && i_ + 1 < s_.size() && (s_[i_ + 1] == '=' || s_[i_ + 1] == '!'))
          return Unsupported("lookbehind");
        if (Eat(':')) {
        } else if (Eat('<')) {
          while (i_ < s_.size() && s_[i_] != '>') ++i_;
          if (!Eat('>')) return Error("unterminated group name");
        } else {
          return Unsupported("group modifier '(?" +
                             (i_ < s_.size() ? std::string(1, static_cast<char>(s_[i_])) : "") +
                             "'");
        }
      }
      auto inner = Disjunction(depth + 1);
      if (!inner.ok()) return inner;
      if (!Eat(')')) return Error("missing ')'");
      return inner;
    }
    if (c == '*' || c == '+' || c == '?') return Error("nothing to repeat");
    if (c == '{') {
      int a, b;
      const size_t save = ++i_;
      if (Braces(&a, &b)) {
        i_ = save - 1;
        return Error("nothing to repeat");
      }
      return Set({{'{', '{'}});
    }
    if (c == '.') {
      ++i_;
      return Set(AnyButLineTerminators());
    }
    if (c == '[') return Class();
    if (c == '\\') {
      ++i_;
      CpSet set;
      auto st = Escape(/*in_class=*/false, &set);
      if (!st.ok()) return st;
      return Set(std::move(set));
    }
    ++i_;
    return Set({{c, c}});
  }

  static Node Marker(Node::Kind kind) {
    Node n;
    n.kind = kind;
    return n;
  }

  static Node Set(CpSet set) {
    Node n;
    n.kind = Node::kSet;
    n.set = NormalizeSet(std::move(set));
    return n;
  }

  StatusOr<uint32_t> Hex(size_t digits) {
    uint32_t v = 0;
    for (size_t k = 0; k < digits; ++k) {
      if (i_ >= s_.size()) return Error("truncated escape");
      const char32_t d = s_[i_++];
      int h = -1;
      if (d >= '0' && d <= '9') h = static_cast<int>(d - '0');
      if (d >= 'a' && d <= 'f') h = static_cast<int>(d - 'a' + 10);
      if (d >= 'A' && d <= 'F') h = static_cast<int>(d - 'A' + 10);
      if (h < 0) return Error("bad hexadecimal escape");
      v = v * 16 + static_cast<uint32_t>(h);
    }
    return v;
  }

  // After a backslash. Single characters come back as a one-point set.
  Status Escape(bool in_class, CpSet* out) {
    if (i_ >= s_.size()) return Error("pattern ends with '\\'");
    const char32_t c = s_[i_++];
    auto one = [&](uint32_t cp) {
      *out = {{cp, cp}};
      return Status::Ok();
    };
    switch (c) {
      case 'd':
        *out = Digits();
        return Status::Ok();
      case 'D':
        *out = ComplementSet(Digits());
        return Status::Ok();
      case 'w':
        *out = Word();
        return Status::Ok();
      case 'W':
        *out = ComplementSet(Word());
        return Status::Ok();
      case 's':
        *out = Space();
        return Status::Ok();
      case 'S':
        *out = ComplementSet(Space());
        return Status::Ok();
      case 't':
        return one('\t');
      case 'n':
        return one('\n');
      case 'v':
        return one('\v');
      case 'f':
        return one('\f');
      case 'r':
        return one('\r');
      case 'b':
        if (in_class) return one('\b');
        --i_;
        return Unsupported("word boundary \\b");
      case 'B':
        --i_;
        return Unsupported("word boundary \\B");
      case 'p':
      case 'P':
        --i_;
        return Unsupported("Unicode property escape \\" + std::string(1, static_cast<char>(c)));
      case 'k':
        --i_;
        return Unsupported("named backreference \\k");
      case 'c': {
        if (i_ < s_.size() &&
            ((s_[i_] >= 'a' && s_[i_] <= 'z') || (s_[i_] >= 'A' && s_[i_] <= 'Z')))
          return one(s_[i_++] % 32);
        return one('\\');  // Annex B: "\c" not followed by a letter is a backslash
      }
      case '0':
        if (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') return Unsupported("octal escape");
        return one(0);
      case 'x': {
        auto v = Hex(2);
        if (!v.ok()) return v.status();
        return one(*v);
      }
      case 'u': {
        if (Eat('{')) {
          uint32_t v = 0;
          size_t n = 0;
          while (i_ < s_.size() && s_[i_] != '}') {
            auto h = Hex(1);
            if (!h.ok()) return h.status();
            v = v * 16 + *h;
            if (++n > 6 || v > kMaxCodepoint) return Error("\\u{} escape out of range");
          }
          if (!Eat('}') || n == 0) return Error("bad \\u{} escape");
          return one(v);
        }
        auto v = Hex(4);
        if (!v.ok()) return v.status();
        uint32_t cp = *v;
        // A surrogate pair spelled as two escapes is one character.
        if (cp >= 0xD800 && cp <= 0xDBFF && i_ + 6 <= s_.size() && s_[i_] == '\\' &&
            s_[i_ + 1] == 'u') {
          const size_t save = i_;
          i_ += 2;
          auto low = Hex(4);
          if (low.ok() && *low >= 0xDC00 && *low <= 0xDFFF) {
            cp = 0x10000 + ((cp - 0xD800) << 10) + (*low - 0xDC00);
          } else {
            i_ = save;
          }
        }
        if (cp >= 0xD800 && cp <= 0xDFFF) return Unsupported("lone surrogate escape");
        return one(cp);
      }
      default:
        if (c >= '1' && c <= '9') {
          --i_;
          return Unsupported("backreference");
        }
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
          // ECMAScript (with the u flag, as JSON Schema's pattern is
          // checked) refuses these; read as the letter, Python's \Z or \A
          // would silently match a 'Z' or an 'A'.
          --i_;
          return Unsupported("escape \\" + std::string(1, static_cast<char>(c)) +
                             (c == 'A' || c == 'Z' || c == 'z' ? " (anchors are ^ and $)" : ""));
        }
        return one(c);  // identity escape of a syntax character
    }
  }

  StatusOr<Node> Class() {
    ++i_;  // '['
    const bool negate = Eat('^');
    CpSet set;
    while (true) {
      if (i_ >= s_.size()) return Error("unterminated character class");
      if (At(']')) {
        ++i_;
        break;
      }
      CpSet lo_set;
      auto item = [&](CpSet* out) -> Status {
        if (Eat('\\')) return Escape(/*in_class=*/true, out);
        const char32_t c = s_[i_++];
        *out = {{c, c}};
        return Status::Ok();
      };
      PDSERVE_RETURN_IF_ERROR(item(&lo_set));
      if (At('-') && i_ + 1 < s_.size() && s_[i_ + 1] != ']') {
        ++i_;
        CpSet hi_set;
        PDSERVE_RETURN_IF_ERROR(item(&hi_set));
        if (lo_set.size() != 1 || hi_set.size() != 1 || lo_set[0].lo != lo_set[0].hi ||
            hi_set[0].lo != hi_set[0].hi) {
          // Annex B: a class escape in a range makes '-' literal.
          set.insert(set.end(), lo_set.begin(), lo_set.end());
          set.push_back({'-', '-'});
          set.insert(set.end(), hi_set.begin(), hi_set.end());
          continue;
        }
        if (hi_set[0].lo < lo_set[0].lo) return Error("range out of order in character class");
        set.push_back({lo_set[0].lo, hi_set[0].lo});
        continue;
      }
      set.insert(set.end(), lo_set.begin(), lo_set.end());
    }
    set = NormalizeSet(std::move(set));
    if (negate) set = ComplementSet(set);
    return Set(std::move(set));
  }

  std::u32string s_;
  size_t i_ = 0;
};

class Emitter {
 public:
  Emitter(CpNfa* nfa, size_t limit) : nfa_(nfa), limit_(limit) {}

  Status Emit(const Node& n, int from, int to) {
    if (nfa_->size() > limit_) {
      return Status::ResourceExhausted("pattern is too complex: more than " +
                                       std::to_string(limit_) + " automaton states");
    }
    switch (n.kind) {
      case Node::kSet:
        nfa_->AddSet(from, n.set, to);
        return Status::Ok();
      case Node::kStart:
        nfa_->AddEps(from, to, CpNfa::Assert::kStart);
        return Status::Ok();
      case Node::kEnd:
        nfa_->AddEps(from, to, CpNfa::Assert::kEnd);
        return Status::Ok();
      case Node::kAlt:
        for (const Node& k : n.kids) {
          const int a = nfa_->AddState(), b = nfa_->AddState();
          nfa_->AddEps(from, a);
          PDSERVE_RETURN_IF_ERROR(Emit(k, a, b));
          nfa_->AddEps(b, to);
        }
        return Status::Ok();
      case Node::kSeq: {
        int at = from;
        for (const Node& k : n.kids) {
          const int next = nfa_->AddState();
          PDSERVE_RETURN_IF_ERROR(Emit(k, at, next));
          at = next;
        }
        nfa_->AddEps(at, to);
        return Status::Ok();
      }
      case Node::kRepeat: {
        const Node& k = n.kids[0];
        int at = from;
        for (int c = 0; c < n.min; ++c) {
          const int next = nfa_->AddState();
          PDSERVE_RETURN_IF_ERROR(Emit(k, at, next));
          at = next;
        }
        if (n.max < 0) {
          const int a = nfa_->AddState(), b = nfa_->AddState();
          nfa_->AddEps(at, a);
          PDSERVE_RETURN_IF_ERROR(Emit(k, a, b));
          nfa_->AddEps(b, a);
          nfa_->AddEps(a, to);
          return Status::Ok();
        }
        for (int c = n.min; c < n.max; ++c) {
          nfa_->AddEps(at, to);
          const int next = nfa_->AddState();
          PDSERVE_RETURN_IF_ERROR(Emit(k, at, next));
          at = next;
        }
        nfa_->AddEps(at, to);
        return Status::Ok();
      }
    }
    return Status::Ok();
  }

 private:
  CpNfa* nfa_;
  size_t limit_;
};

}  // namespace

StatusOr<CpDfa> CompileRegex(std::string_view pattern, const RegexOptions& options) {
  Parser parser(DecodeUtf8(std::string(pattern)));
  auto ast = parser.Parse();
  if (!ast.ok()) return ast.status();
  CpNfa nfa;
  nfa.start = nfa.AddState();
  nfa.accept = nfa.AddState();
  Emitter emitter(&nfa, options.max_nfa_states);
  int from = nfa.start, to = nfa.accept;
  if (!options.full_match) {
    // A match anywhere: any prefix before, any suffix after.
    const CpSet any = ComplementSet({});
    from = nfa.AddState();
    to = nfa.AddState();
    nfa.AddEps(nfa.start, from);
    nfa.AddSet(nfa.start, any, nfa.start);
    nfa.AddEps(to, nfa.accept);
    nfa.AddSet(nfa.accept, any, nfa.accept);
  }
  PDSERVE_RETURN_IF_ERROR(emitter.Emit(*ast, from, to));
  auto dfa = CpDfa::FromNfa(nfa, options.max_dfa_states, "pattern");
  if (!dfa.ok()) return dfa.status();
  dfa->Prune();
  return dfa;
}

}  // namespace pdserve::structured

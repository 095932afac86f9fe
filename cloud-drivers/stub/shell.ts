/**
 * A small subset of sh, enough to read the commands the dispatcher sends to an instance: words with single
 * and double quotes, backslashes, `$VAR` / `${VAR}` / `${VAR:-default}` expansion, `&&`, `||`, `;`,
 * newlines, pipes, `( ... )` groups and the redirections `>`, `>>`, `<`, `n>`, `n>&m`. Anything else (command
 * substitution, here-documents, background jobs) is a ShellSyntaxError.
 */

export type RedirectOp = ">" | ">>" | "<" | ">&";
export interface Redirect {
  fd: number;
  op: RedirectOp;
  target: string;
}
export interface SimpleCommand {
  kind: "simple";
  words: string[];
  redirects: Redirect[];
}
export interface GroupCommand {
  kind: "group";
  body: CommandList;
  redirects: Redirect[];
}
export type Command = SimpleCommand | GroupCommand;
export type Pipeline = Command[];
export type Connector = "&&" | "||" | ";";
/** Runs `first`, then each `rest` item according to its connector and the status so far. */
export interface CommandList {
  first: Pipeline;
  rest: Array<{ op: Connector; pipeline: Pipeline }>;
}

export class ShellSyntaxError extends Error {
  override name = "ShellSyntaxError";
}

type Token =
  | { t: "word"; v: string }
  | { t: "op"; v: "&&" | "||" | ";" | "|" | "(" | ")" }
  | { t: "redir"; fd: number; op: RedirectOp };

export function parseShell(src: string, env: Readonly<Record<string, string>> = {}): CommandList {
  const tokens = tokenize(src, env);
  const parser = new Parser(tokens);
  const list = parser.list();
  if (parser.pos < tokens.length) throw new ShellSyntaxError(`unexpected ${describe(tokens[parser.pos])}`);
  return list;
}

function describe(tok: Token | undefined): string {
  if (tok === undefined) return "end of command";
  return tok.t === "redir" ? "redirection" : JSON.stringify(tok.v);
}

class Parser {
  pos = 0;
  constructor(private readonly tokens: Token[]) {}

  private peek(): Token | undefined {
    return this.tokens[this.pos];
  }

  private isOp(v: string): boolean {
    const tok = this.peek();
    return tok !== undefined && tok.t === "op" && tok.v === v;
  }

  list(): CommandList {
    while (this.isOp(";")) this.pos++;
    const first = this.pipeline();
    const rest: CommandList["rest"] = [];
    for (;;) {
      const tok = this.peek();
      if (tok === undefined || tok.t !== "op" || !(tok.v === "&&" || tok.v === "||" || tok.v === ";")) break;
      this.pos++;
      const op = tok.v;
      if (op === ";") {
        while (this.isOp(";")) this.pos++;
        const next = this.peek();
        if (next === undefined || (next.t === "op" && next.v === ")")) break;
      }
      rest.push({ op, pipeline: this.pipeline() });
    }
    return { first, rest };
  }

  private pipeline(): Pipeline {
    const cmds = [this.command()];
    while (this.isOp("|")) {
      this.pos++;
      cmds.push(this.command());
    }
    return cmds;
  }

  private command(): Command {
    if (this.isOp("(")) {
      this.pos++;
      const body = this.list();
      if (!this.isOp(")")) throw new ShellSyntaxError(`expected ")" but found ${describe(this.peek())}`);
      this.pos++;
      const redirects: Redirect[] = [];
      while (this.peek()?.t === "redir") redirects.push(this.redirect());
      return { kind: "group", body, redirects };
    }
    const words: string[] = [];
    const redirects: Redirect[] = [];
    for (;;) {
      const tok = this.peek();
      if (tok?.t === "word") {
        words.push(tok.v);
        this.pos++;
      } else if (tok?.t === "redir") {
        redirects.push(this.redirect());
      } else break;
    }
    if (words.length === 0 && redirects.length === 0) {
      throw new ShellSyntaxError(`expected a command but found ${describe(this.peek())}`);
    }
    return { kind: "simple", words, redirects };
  }

  private redirect(): Redirect {
    const tok = this.tokens[this.pos++] as Extract<Token, { t: "redir" }>;
    const target = this.peek();
    if (target?.t !== "word") throw new ShellSyntaxError(`expected a file after ${tok.op}`);
    this.pos++;
    return { fd: tok.fd, op: tok.op, target: target.v };
  }
}

function tokenize(src: string, env: Readonly<Record<string, string>>): Token[] {
  const out: Token[] = [];
  let word = "";
  let inWord = false;
  let quoted = false;
  const flush = () => {
    if (inWord && (word !== "" || quoted)) out.push({ t: "word", v: word });
    word = "";
    inWord = false;
    quoted = false;
  };
  let i = 0;
  while (i < src.length) {
    const c = src[i] as string;
    if (c === " " || c === "\t" || c === "\r") {
      flush();
      i++;
    } else if (c === "\n") {
      flush();
      out.push({ t: "op", v: ";" });
      i++;
    } else if (c === "#" && !inWord) {
      while (i < src.length && src[i] !== "\n") i++;
    } else if (c === "'") {
      const end = src.indexOf("'", i + 1);
      if (end < 0) throw new ShellSyntaxError("unterminated single quote");
      word += src.slice(i + 1, end);
      inWord = quoted = true;
      i = end + 1;
    } else if (c === '"') {
      inWord = quoted = true;
      i++;
      for (;;) {
        if (i >= src.length) throw new ShellSyntaxError("unterminated double quote");
        const d = src[i] as string;
        if (d === '"') {
          i++;
          break;
        }
        if (d === "\\" && i + 1 < src.length && '"\\$`\n'.includes(src[i + 1] as string)) {
          if (src[i + 1] !== "\n") word += src[i + 1];
          i += 2;
        } else if (d === "$") {
          const [value, next] = expand(src, i, env);
          word += value;
          i = next;
        } else if (d === "`") {
          throw new ShellSyntaxError("command substitution is not supported");
        } else {
          word += d;
          i++;
        }
      }
    } else if (c === "\\") {
      if (i + 1 < src.length && src[i + 1] !== "\n") {
        word += src[i + 1];
        inWord = true;
      }
      i += 2;
    } else if (c === "$") {
      const [value, next] = expand(src, i, env);
      word += value;
      inWord = true;
      i = next;
    } else if (c === "`") {
      throw new ShellSyntaxError("command substitution is not supported");
    } else if (c === "&" || c === "|" || c === ";" || c === "(" || c === ")") {
      flush();
      const two = src.slice(i, i + 2);
      if (two === "&&" || two === "||") {
        out.push({ t: "op", v: two });
        i += 2;
      } else if (c === "&") {
        throw new ShellSyntaxError("background jobs (&) are not supported");
      } else if (two === ";;") {
        throw new ShellSyntaxError("case statements are not supported");
      } else {
        out.push({ t: "op", v: c });
        i++;
      }
    } else if (c === ">" || c === "<") {
      let fd = c === ">" ? 1 : 0;
      if (inWord && !quoted && /^\d$/.test(word)) {
        fd = Number(word);
        word = "";
        inWord = false;
      } else flush();
      let op: RedirectOp;
      if (c === "<") {
        if (src[i + 1] === "<") throw new ShellSyntaxError("here-documents are not supported");
        op = "<";
        i++;
      } else if (src[i + 1] === ">") {
        op = ">>";
        i += 2;
      } else if (src[i + 1] === "&") {
        op = ">&";
        i += 2;
      } else {
        op = ">";
        i += src[i + 1] === "|" ? 2 : 1;
      }
      out.push({ t: "redir", fd, op });
    } else {
      word += c;
      inWord = true;
      i++;
    }
  }
  flush();
  return out;
}

/** Expands the `$...` at src[i]; returns the value and the index after it. Unset variables are empty. */
function expand(src: string, i: number, env: Readonly<Record<string, string>>): [string, number] {
  const next = src[i + 1];
  if (next === "{") {
    const end = src.indexOf("}", i + 2);
    if (end < 0) throw new ShellSyntaxError("unterminated ${");
    const body = src.slice(i + 2, end);
    const m = /^([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)(.*))?$/s.exec(body);
    if (m === null) throw new ShellSyntaxError(`unsupported expansion \${${body}}`);
    const [, name, op, fallback] = m as unknown as [string, string, string | undefined, string | undefined];
    const value = env[name];
    if (op === ":-" && (value === undefined || value === "")) return [unquote(fallback ?? ""), end + 1];
    if (op === "-" && value === undefined) return [unquote(fallback ?? ""), end + 1];
    return [value ?? "", end + 1];
  }
  if (next === "(") throw new ShellSyntaxError("command substitution is not supported");
  const m = /^[A-Za-z_][A-Za-z0-9_]*/.exec(src.slice(i + 1));
  if (m === null) return ["$", i + 1];
  return [env[m[0]] ?? "", i + 1 + m[0].length];
}

function unquote(s: string): string {
  return s.replace(/^(['"])(.*)\1$/s, "$2");
}

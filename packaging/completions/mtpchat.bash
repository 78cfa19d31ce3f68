# bash completion for mtpchat, generated from its argument parser by packaging/completions.py.
# Install: copy to /usr/share/bash-completion/completions/mtpchat
# (or ~/.local/share/bash-completion/completions/mtpchat), or `source` it from ~/.bashrc.
_mtpchat() {
    local cur prev sub i
    COMPREPLY=()
    cur="${COMP_WORDS[COMP_CWORD]}"
    prev="${COMP_WORDS[COMP_CWORD-1]}"
    local commands="chat run bench pull models doctor"
    sub=""
    for ((i = 1; i < COMP_CWORD; i++)); do
        case "${COMP_WORDS[i]}" in
            chat|run|bench|pull|models|doctor) sub="${COMP_WORDS[i]}"; break ;;
        esac
    done

    case "$prev" in
        --model|--mtp-from|--draft-model) COMPREPLY=($(compgen -d -- "$cur")); return ;;
        --device) COMPREPLY=($(compgen -W "cpu cuda" -- "$cur")); return ;;
        --dtype) COMPREPLY=($(compgen -W "float32 bfloat16 float16" -- "$cur")); return ;;
        --max-context|--depth|--tp|--prompt|--system|--max-new-tokens|--temperature|--top-p|--top-k|--seed|--think-budget|--layers|--depths|--draft-layers|--acceptance|--acceptance-profile|--prompt-tokens|--repeat) return ;;
        --embed-on-host) COMPREPLY=($(compgen -W "auto on off" -- "$cur")); return ;;
        --kv-cache-dtype) COMPREPLY=($(compgen -W "auto fp8" -- "$cur")); return ;;
        --drafter) COMPREPLY=($(compgen -W "mtp draft auto" -- "$cur")); return ;;
        --prompt-file|--out) COMPREPLY=($(compgen -f -- "$cur")); return ;;
        --random-weights) COMPREPLY=($(compgen -W "qwen3.5-27b qwen3-next-80b-a3b tiny qwen3-0.6b qwen3.5-0.8b" -- "$cur")); return ;;
        --quant) COMPREPLY=($(compgen -W "bf16 fp8 int4" -- "$cur")); return ;;
    esac

    local opts
    case "$sub" in
        "") opts="$commands --help --version" ;;
        chat) opts="--help --model --device --dtype --max-context --compile --embed-on-host --kv-cache-dtype --mtp-from --depth --think --no-think --draft-model --drafter --tp" ;;
        run) opts="--help --prompt --prompt-file --model --device --dtype --max-context --compile --embed-on-host --kv-cache-dtype --mtp-from --system --raw --max-new-tokens --ignore-eos --depth --temperature --top-p --top-k --seed --think --no-think --think-budget --show-thinking --json --draft-model --drafter --tp" ;;
        bench) opts="--help --model --device --dtype --max-context --compile --embed-on-host --kv-cache-dtype --mtp-from --random-weights --layers --quant --depths --drafter --draft-model --draft-layers --acceptance --acceptance-profile --max-new-tokens --prompt --prompt-tokens --repeat --no-hf --no-graphs --temperature --top-p --top-k --json --out --precision --tp" ;;
        pull) opts="--help --yes --quiet --dry-run --device qwen3.5 qwen3.6 qwen3-next qwen3.5-0.8b qwen3.5-0.8b-fp8 qwen3.5-2b qwen3.5-2b-fp8 qwen3.5-4b qwen3.5-4b-fp8 qwen3.5-9b qwen3.5-9b-fp8 qwen3.5-27b qwen3.5-27b-fp8 qwen3.5-35b-a3b qwen3.5-35b-a3b-fp8 qwen3.5-122b-a10b qwen3.5-122b-a10b-fp8 qwen3.6-27b qwen3.6-27b-fp8 qwen3.6-35b-a3b qwen3.6-35b-a3b-fp8 qwen3-next-80b-a3b-instruct qwen3-next-80b-a3b-instruct-fp8 qwen3-next-80b-a3b-thinking qwen3-next-80b-a3b-thinking-fp8" ;;
        models) opts="--help --json --device --available"; COMPREPLY=($(compgen -d -- "$cur")) ;;
        doctor) opts="--help --json --model --device" ;;
    esac
    COMPREPLY+=($(compgen -W "$opts" -- "$cur"))
}
complete -F _mtpchat mtpchat

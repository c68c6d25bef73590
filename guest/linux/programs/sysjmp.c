/* System-call sites as the runtime's syscall=jmp rewrite sees them, each
 * called three times (the first call traps and may rewrite the site, the
 * next ones run whatever is there then):
 * - fixed: `mov $39,%eax; syscall` within 16 aligned bytes: rewritten;
 * - either: the same `mov`, but a second path jumps straight to the
 *   `syscall` with another number in rax: that path must still trap and
 *   be served with its own number;
 * - reg: the number in a register (`mov %rdi,%rax`): left trapping;
 * - split: `mov $39,%eax` across a 16-byte boundary: left trapping;
 * - redzone: values in the red zone below rsp survive a rewritten call.
 * Prints one line per case with ok=1 when it behaved as on Linux. */
#include <stdio.h>
#include <unistd.h>

long sj_fixed(void);
long sj_either(long jump, long nr);
long sj_reg(long nr);
long sj_split(void);
long sj_redzone(void);

__asm__(
    ".text\n"
    ".p2align 4\n"
    ".byte 0x90\n"
    "sj_fixed:\n"
    "  mov $39, %eax\n"
    "  syscall\n"
    "  ret\n"

    ".p2align 4\n"
    ".byte 0x90\n"
    "sj_either:\n"
    "  mov %rsi, %rax\n"
    "  test %rdi, %rdi\n"
    "  jnz 1f\n"
    "  mov $39, %eax\n"
    "1:\n"
    "  syscall\n"
    "  ret\n"

    ".p2align 4\n"
    "sj_reg:\n"
    "  mov %rdi, %rax\n"
    "  syscall\n"
    "  ret\n"

    ".p2align 4\n"
    ".fill 13, 1, 0x90\n"
    "sj_split:\n"
    "  mov $39, %eax\n"
    "  syscall\n"
    "  ret\n"

    ".p2align 4\n"
    ".byte 0x90\n"
    "sj_redzone:\n"
    "  movq $0x1234567, -8(%rsp)\n"
    "  movq $0x7654321, -128(%rsp)\n"
    "  mov $39, %eax\n"
    "  syscall\n"
    "  cmpq $0x1234567, -8(%rsp)\n"
    "  jne 2f\n"
    "  cmpq $0x7654321, -128(%rsp)\n"
    "  jne 2f\n"
    "  ret\n"
    "2:\n"
    "  mov $-1, %rax\n"
    "  ret\n");

int main(void) {
    long pid = getpid();
    int fixed = 1, either = 1, reg = 1, split = 1, redzone = 1;
    for (int i = 0; i < 3; i++) {
        fixed &= sj_fixed() == pid;
        either &= sj_either(0, 0) == pid;
        /* getuid: 0 here; the jumping path must not run the `mov $39`. */
        either &= sj_either(1, 102) == getuid();
        reg &= sj_reg(39) == pid;
        split &= sj_split() == pid;
        redzone &= sj_redzone() == pid;
    }
    printf("sysjmp: fixed ok=%d\n", fixed);
    printf("sysjmp: either ok=%d\n", either);
    printf("sysjmp: reg ok=%d\n", reg);
    printf("sysjmp: split ok=%d\n", split);
    printf("sysjmp: redzone ok=%d\n", redzone);
    return !(fixed && either && reg && split && redzone);
}

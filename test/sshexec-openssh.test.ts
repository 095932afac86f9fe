import { sshExecutorSuite } from "./sshexec-suite.ts";

sshExecutorSuite("openssh");

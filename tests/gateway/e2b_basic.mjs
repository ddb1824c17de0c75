// The E2B JavaScript SDK's basic script against the gateway: create, run, write,
// read, kill. Configured only by E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL.
import { Sandbox, CommandExitError } from 'e2b'

const sbx = await Sandbox.create('base', { envs: { GREETING: 'hello js' } })
const ran = await sbx.commands.run('echo $GREETING; echo err >&2')
let exitCode = null
try {
  await sbx.commands.run('exit 4')
} catch (e) {
  if (!(e instanceof CommandExitError)) throw e
  exitCode = e.exitCode
}
await sbx.files.write('/tmp/js.txt', 'written by js')
const read = await sbx.files.read('/tmp/js.txt')
const killed = await sbx.kill()
console.log(JSON.stringify({ stdout: ran.stdout, stderr: ran.stderr, exitCode, read, killed }))

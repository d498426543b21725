package browsertest

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
	_ "github.com/onceflow/onceflow/broker/sqlitequeue"
	"github.com/onceflow/onceflow/console"
	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
	_ "github.com/onceflow/onceflow/sqldb/sqlite"
)

// chromium returns the path of the browser: $ONCEFLOW_TEST_CHROMIUM, else the first of the
// usual names on PATH. Without one it fails the test under CI and skips it otherwise.
func chromium(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("ONCEFLOW_TEST_CHROMIUM"); p != "" {
		return p
	}
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome", "google-chrome-stable"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	testsvc.Unavailable(t, "Chromium", "no chromium on PATH: install the Debian package chromium (apt-get install -y chromium), or set ONCEFLOW_TEST_CHROMIUM")
	return ""
}

// browser starts a headless Chromium for the test, with a fresh profile and none of its calls
// home, and returns a tab's context.
func browser(t *testing.T, path string) context.Context {
	t.Helper()
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(path),
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.WindowSize(1280, 820),
	)
	alloc, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancel := chromedp.NewContext(alloc)
	t.Cleanup(func() {
		cancel()
		cancelAlloc()
	})
	ctx, cancelTimeout := context.WithTimeout(ctx, 2*time.Minute)
	t.Cleanup(cancelTimeout)
	return ctx
}

// screenshots says where the test writes its screenshots: docs/console when
// ONCEFLOW_SCREENSHOTS=1 asks for them, a temporary directory otherwise.
func screenshots(t *testing.T) string {
	if os.Getenv("ONCEFLOW_SCREENSHOTS") == "1" {
		dir := filepath.Join("..", "..", "docs", "console")
		require.NoError(t, os.MkdirAll(dir, 0o755))
		return dir
	}
	return t.TempDir()
}

// Payment is what the service books.
type Payment struct {
	Cents int64 `json:"cents"`
}

// service is a payments service on the embedded default (a SQLite queue, a SQLite database)
// with the console mounted at /ops/onceflow/.
type service struct {
	url    string
	db     *sqldb.DB
	queue  *broker.Broker
	router *onceflow.Router
	fixed  atomic.Bool // refunds (negative amounts) are accepted
}

func startService(t *testing.T) *service {
	t.Helper()
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "payments-") // short: the page shows the paths
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	s := &service{}
	q, err := broker.Open(ctx, "sqlite://"+filepath.Join(dir, "queue.db"), broker.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, q.Close()) })
	db, err := sqldb.Open(ctx, "sqlite://"+filepath.Join(dir, "app.db"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	_, err = db.ExecContext(ctx, `CREATE TABLE ledger (payment_id TEXT NOT NULL, cents BIGINT NOT NULL)`)
	require.NoError(t, err)
	s.queue, s.db = q, db

	// Each booking sends a receipt through the outbox, whose relay runs elsewhere: the
	// receipts wait there.
	receipts, err := outbox.New(db, outbox.Config{})
	require.NoError(t, err)
	r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: q.Publisher(), PurgeInterval: -1, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	r.AddMigration(receipts.Migrate)
	sub, err := q.Subscriber()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler(onceflow.Handler{
		Name: "ledger", Topic: "payments", Subscriber: sub, DB: db, QoS: onceflow.ExactlyOnce, Concurrency: 2,
		Processor: processor.JSON(func(ctx context.Context, msg *messagedata.MessageData, p Payment) error {
			if p.Cents <= 0 && !s.fixed.Load() {
				return processor.Permanent(fmt.Errorf("payment %s: amount %d must be positive", msg.ID, p.Cents))
			}
			tx, _ := processor.TxFromContext(ctx)
			if _, err := tx.ExecContext(ctx, `INSERT INTO ledger (payment_id, cents) VALUES (?, ?)`, msg.ID, p.Cents); err != nil {
				return err
			}
			return receipts.Publish(ctx, "receipts", message.NewMessage(outbox.DerivedID(msg.ID, "receipt"), msg.Payload))
		}),
	}))
	testsvc.StartRouter(t, r)
	s.router = r

	c, err := console.New(console.Config{Router: r, Broker: q, DB: db, Title: "payments",
		Authorize: func(*http.Request) error { return nil }, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	mux := http.NewServeMux()
	mux.Handle("/ops/onceflow/", http.StripPrefix("/ops/onceflow", c))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	s.url = srv.URL + "/ops/onceflow/"
	return s
}

func (s *service) publish(t *testing.T, id, payload string) {
	t.Helper()
	require.NoError(t, s.queue.Publisher().Publish("payments", message.NewMessage(id, []byte(payload))))
}

// booked returns how many ledger rows payment id has.
func (s *service) booked(t *testing.T, id string) int {
	t.Helper()
	var n int
	require.NoError(t, s.db.Get(&n, `SELECT COUNT(*) FROM ledger WHERE payment_id = ?`, id))
	return n
}

// The operator's path: the console shows the handler and its rate; a dead letter is found by
// its reason, opened and replayed once the fix is in; the payment is then booked exactly once.
// A dead letter whose id and payload hold markup shows them as text and runs nothing.
func TestConsole_AnOperatorFindsAndReplaysADeadLetterThatIsThenAppliedOnce(t *testing.T) {
	path := chromium(t)
	started := time.Now()
	s := startService(t)
	const good = 40
	for i := range good {
		s.publish(t, fmt.Sprintf("pay-%03d", i+1), fmt.Sprintf(`{"cents": %d}`, 100*(i+1)))
	}
	s.publish(t, "pay-refund-17", `{"cents": -1250}`)
	const evilID = `evil-<img src=x onerror="window.owned=1">`
	const evilPayload = `<script>window.owned=2</script>`
	s.publish(t, evilID, evilPayload)
	testsvc.Eventually(t, 30*time.Second, func() bool {
		c := s.router.Status()[0].Counts
		return c.Processed == good && c.DeadLettered == 2
	}, "the service never settled its %d payments and 2 dead letters: %+v", good, s.router.Status())
	// The purge ran once, from cron say.
	keys, err := dedup.New(s.db, dedup.Config{})
	require.NoError(t, err)
	_, err = keys.Purge(context.Background(), dedup.PurgeOptions{})
	require.NoError(t, err)

	ctx := browser(t, path)
	dialogs := chromedp.Events(ctx, page.JavascriptDialogOpening)
	var opened atomic.Int32
	go func() {
		for _, err := range dialogs {
			if err != nil {
				return
			}
			opened.Add(1)
			_, _ = chromedp.Call(ctx, page.HandleJavaScriptDialog, page.HandleJavaScriptDialogParams{Accept: true})
		}
	}()
	shots := screenshots(t)
	shoot := func(name string) {
		t.Helper()
		png, err := chromedp.Run(ctx, chromedp.CaptureScreenshot())
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(shots, name), png, 0o644))
	}
	wait := func(what, expr string) {
		t.Helper()
		_, err := chromedp.Run(ctx, chromedp.Poll[chromedp.Void](expr, chromedp.WithPollingInterval(50*time.Millisecond), chromedp.WithPollingTimeout(20*time.Second)))
		require.NoError(t, err, "waiting for %s", what)
	}
	text := func(sel string) string {
		t.Helper()
		v, err := chromedp.Run(ctx, chromedp.Evaluate[string](`document.querySelector(`+jsString(sel)+`).textContent`))
		require.NoError(t, err, sel)
		return v
	}

	// The handler and its rate.
	require.NoError(t, chromedp.Do(ctx, chromedp.Navigate(s.url)))
	wait("the handler's rate", `(() => { const c = document.querySelector('tr[data-handler="ledger"] td.rate'); return c && /^[0-9.]+\/s$/.test(c.textContent) && c.textContent !== "0.00/s"; })()`)
	require.Regexp(t, `^[0-9.]+/s$`, text(`tr[data-handler="ledger"] td.rate`))
	require.Equal(t, "running", text(`tr[data-handler="ledger"] .state-running`))
	require.Equal(t, "ExactlyOnce", text(`tr[data-handler="ledger"] td:nth-child(3)`))
	shoot("handlers.png")

	// The dead letters, then the one whose reason says the amount must be positive.
	require.NoError(t, chromedp.Do(ctx, chromedp.Click(chromedp.CSS(`nav a[data-view="dead-letters"]`))))
	wait("the two dead letters", `document.querySelectorAll("#dl-table tbody tr").length === 2`)
	shoot("dead-letters.png")
	require.NoError(t, chromedp.Do(ctx,
		chromedp.SendKeys(chromedp.CSS(`#dl-filter input[name="reason"]`), "must be positive"),
		chromedp.Click(chromedp.ID("dl-search")),
	))
	wait("the dead letter found by its reason", `(() => { const r = document.querySelectorAll("#dl-table tbody tr"); return r.length === 1 && r[0].getAttribute("data-id") === "pay-refund-17"; })()`)
	require.NoError(t, chromedp.Do(ctx, chromedp.Click(chromedp.CSS(`#dl-table tbody a.letter-link`))))
	wait("the dead letter in full", `document.querySelector("#letter-reason") && document.querySelector("#letter-reason").textContent.includes("must be positive")`)
	require.Equal(t, "permanent: payment pay-refund-17: amount -1250 must be positive", text("#letter-reason"))
	require.Equal(t, "{\n  \"cents\": -1250\n}", text("#letter-payload"), "the payload, as JSON")
	shoot("dead-letter.png")

	// The fix is deployed; the operator replays, confirms, and reads the report.
	s.fixed.Store(true)
	require.NoError(t, chromedp.Do(ctx, chromedp.Click(chromedp.ID("letter-replay"))))
	wait("the confirmation", `!document.querySelector("#confirm").hidden`)
	require.Contains(t, text("#confirm-text"), "Replay 1 dead letter to the topic each came from?")
	require.Zero(t, s.booked(t, "pay-refund-17"), "nothing is replayed before the confirmation")
	require.NoError(t, chromedp.Do(ctx, chromedp.Click(chromedp.ID("confirm-yes"))))
	wait("the report", `document.querySelector("#report-summary") && document.querySelector("#report-summary").textContent === "Replayed 1 dead letter."`)
	shoot("replayed.png")

	// Applied exactly once: the router processed one delivery more, and the ledger has one row.
	testsvc.Eventually(t, 30*time.Second, func() bool { return s.router.Status()[0].Counts.Processed == good+1 },
		"the replayed payment was never processed: %+v", s.router.Status())
	require.Equal(t, 1, s.booked(t, "pay-refund-17"))
	var rows int
	require.NoError(t, s.db.Get(&rows, `SELECT COUNT(*) FROM ledger`))
	require.Equal(t, good+1, rows)
	wait("the list without it", `document.querySelectorAll("#dl-table tbody tr").length === 0 && location.hash === "#dead-letters"`)

	// What a producer put in an id and a payload is shown as text, and runs nothing.
	require.NoError(t, chromedp.Do(ctx, chromedp.Evaluate[chromedp.Void](`location.hash = "dead-letter=" + encodeURIComponent(`+jsString(evilID)+`)`)))
	wait("the dead letter with markup in it", `document.querySelector("#letter-payload").textContent.length > 0`)
	require.Equal(t, evilID, text("#letter-id"))
	require.NoError(t, chromedp.Do(ctx, chromedp.Click(chromedp.CSS(`.formats button[data-format="text"]`))))
	require.Equal(t, evilPayload, text("#letter-payload"))
	clean, err := chromedp.Run(ctx, chromedp.Evaluate[bool](`window.owned === undefined && document.querySelectorAll("script").length === 1 && document.querySelectorAll("img").length === 0`))
	require.NoError(t, err)
	require.True(t, clean, "markup from a message was run or inserted")

	// The storage.
	require.NoError(t, chromedp.Do(ctx, chromedp.Click(chromedp.CSS(`nav a[data-view="storage"]`))))
	wait("the storage", `document.querySelectorAll("#storage-cards .card").length === 3`)
	storage := text("#storage-cards")
	require.Contains(t, storage, "Duplicate detection: onceflow_dedupRows41")
	require.Contains(t, storage, "Outbox: onceflow_outboxRelay grouponceflow_relayWaiting to be sent41")
	require.Contains(t, storage, "Last purgeWhen")
	shoot("storage.png")

	require.Zero(t, opened.Load(), "a dialog opened: a message's markup ran")
	t.Logf("the operator's path took %s, the service's start included", time.Since(started).Round(time.Millisecond))
}

// jsString quotes s as a JavaScript string literal.
func jsString(s string) string {
	var b strings.Builder
	b.WriteByte('"')
	for _, r := range s {
		switch r {
		case '"', '\\':
			b.WriteByte('\\')
			b.WriteRune(r)
		case '\n':
			b.WriteString(`\n`)
		default:
			if r < 0x20 || r == 0x2028 || r == 0x2029 {
				fmt.Fprintf(&b, `\u%04x`, r)
			} else {
				b.WriteRune(r)
			}
		}
	}
	b.WriteByte('"')
	return b.String()
}

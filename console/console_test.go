package console_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
	_ "github.com/onceflow/onceflow/broker/sqlitequeue"
	"github.com/onceflow/onceflow/console"
	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// mount serves c under /ops/ with the prefix stripped, as a service mounts it.
func mount(t *testing.T, c *console.Console) *httptest.Server {
	t.Helper()
	mux := http.NewServeMux()
	mux.Handle("/ops/", http.StripPrefix("/ops", c))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv
}

// queue returns a fresh SQLite queue as a broker, and publishes dead letters to the console's
// default dead-letter topic with it.
func queue(t *testing.T) *broker.Broker {
	t.Helper()
	b, err := broker.Open(context.Background(), "sqlite://"+filepath.Join(t.TempDir(), "queue.db"), broker.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, b.Close()) })
	return b
}

func deadLetter(t *testing.T, b *broker.Broker, id, topic, reason, payload string) {
	t.Helper()
	require.NoError(t, middleware.PublishDeadLetter(context.Background(), b.Publisher(), onceflow.DefaultDeadLetterTopic, "ledger",
		&messagedata.MessageData{ID: id, Topic: topic, Payload: []byte(payload), Headers: map[string]string{"tenant": "7"}},
		errors.New(reason)))
}

func waiting(t *testing.T, b *broker.Broker, topic string) []string {
	t.Helper()
	msgs, err := b.Peek(context.Background(), topic, 100)
	require.NoError(t, err)
	out := []string{}
	for _, m := range msgs {
		out = append(out, m.UUID)
	}
	return out
}

// get requests path of srv and returns the status and body.
func get(t *testing.T, srv *httptest.Server, path string) (int, string) {
	t.Helper()
	res, err := srv.Client().Get(srv.URL + path)
	require.NoError(t, err)
	defer res.Body.Close()
	body, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	return res.StatusCode, string(body)
}

// getJSON requests path, requires 200 and decodes the body into v.
func getJSON(t *testing.T, srv *httptest.Server, path string, v any) {
	t.Helper()
	status, body := get(t, srv, path)
	require.Equal(t, http.StatusOK, status, body)
	require.NoError(t, json.Unmarshal([]byte(body), v), body)
}

// post sends body as JSON to path, from the console's own page (same origin).
func post(t *testing.T, srv *httptest.Server, path, body string, header ...string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, srv.URL+path, strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Sec-Fetch-Site", "same-origin")
	req.Header.Set("Origin", srv.URL)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	res, err := srv.Client().Do(req)
	require.NoError(t, err)
	defer res.Body.Close()
	out, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	return res.StatusCode, string(out)
}

func allow(*http.Request) error { return nil }

func newConsole(t *testing.T, cfg console.Config) *console.Console {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	c, err := console.New(cfg)
	require.NoError(t, err)
	return c
}

func TestConsole_ServesItsPageWithoutInlineScriptAndUnderAnyPrefix(t *testing.T) {
	t.Parallel()
	srv := mount(t, newConsole(t, console.Config{Title: `shop <b>"eu"</b>`}))

	res, err := srv.Client().Get(srv.URL + "/ops/")
	require.NoError(t, err)
	body, _ := io.ReadAll(res.Body)
	res.Body.Close()
	require.Equal(t, http.StatusOK, res.StatusCode)
	require.Equal(t, "text/html; charset=utf-8", res.Header.Get("Content-Type"))
	require.Contains(t, res.Header.Get("Content-Security-Policy"), "script-src 'self'")
	require.Contains(t, res.Header.Get("Content-Security-Policy"), "frame-ancestors 'none'")
	require.Equal(t, "nosniff", res.Header.Get("X-Content-Type-Options"))
	page := string(body)
	require.Equal(t, 1, strings.Count(page, "<script"), "one script, the console's own file")
	require.Contains(t, page, `<script src="assets/console.js" defer></script>`, "relative: it works under any prefix")
	require.Contains(t, page, "shop &lt;b&gt;&#34;eu&#34;&lt;/b&gt;", "the title is escaped")

	status, js := get(t, srv, "/ops/assets/console.js")
	require.Equal(t, http.StatusOK, status)
	for _, markup := range []string{"innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("} {
		require.False(t, strings.Contains(js, markup), "the page's script uses %s: it must put data in as text only", markup)
	}
	status, _ = get(t, srv, "/ops/assets/console.css")
	require.Equal(t, http.StatusOK, status)

	// The mount point without its slash is sent to the slash, where the relative links work.
	c := newConsole(t, console.Config{})
	rec := httptest.NewRecorder()
	http.StripPrefix("/ops", c).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/ops", nil))
	require.Equal(t, http.StatusMovedPermanently, rec.Code)
	require.Equal(t, "/ops/", rec.Header().Get("Location"))
}

func TestConsole_WithoutAnAuthorisationHookRefusesEveryChange(t *testing.T) {
	t.Parallel()
	b := queue(t)
	deadLetter(t, b, "a", "orders", "permanent: bad", `{}`)
	srv := mount(t, newConsole(t, console.Config{Broker: b}))

	var info struct {
		ReadOnly       bool   `json:"read_only"`
		ReadOnlyReason string `json:"read_only_reason"`
	}
	getJSON(t, srv, "/ops/api/info", &info)
	require.True(t, info.ReadOnly)
	require.Contains(t, info.ReadOnlyReason, "console.Config.Authorize")

	for _, path := range []string{"/ops/api/dead-letters/replay", "/ops/api/dead-letters/delete"} {
		status, body := post(t, srv, path, `{"ids": ["a"]}`)
		require.Equal(t, http.StatusForbidden, status, body)
		require.Contains(t, body, "refused: the console is read-only")
	}
	require.Equal(t, []string{"a"}, waiting(t, b, onceflow.DefaultDeadLetterTopic), "nothing changed")
	require.Empty(t, waiting(t, b, "orders"))
}

func TestConsole_RefusesChangesFromOtherSitesAndFormsAndUnauthorisedOnes(t *testing.T) {
	t.Parallel()
	b := queue(t)
	deadLetter(t, b, "a", "orders", "permanent: bad", `{}`)
	srv := mount(t, newConsole(t, console.Config{Broker: b, Authorize: func(r *http.Request) error {
		if r.Header.Get("X-Operator") == "" {
			return errors.New("no operator signed in")
		}
		return nil
	}}))
	const replay = "/ops/api/dead-letters/replay"

	// A page of another site making the operator's browser post.
	status, body := post(t, srv, replay, `{"ids": ["a"]}`, "X-Operator", "ann", "Sec-Fetch-Site", "cross-site", "Origin", "https://evil.example")
	require.Equal(t, http.StatusForbidden, status, body)
	require.Contains(t, body, "refused: cross-origin request detected")
	// A form post, which a page of another site can send without a preflight.
	status, body = post(t, srv, replay, `ids=a`, "X-Operator", "ann", "Content-Type", "application/x-www-form-urlencoded")
	require.Equal(t, http.StatusUnsupportedMediaType, status, body)
	// The service's hook says no.
	status, body = post(t, srv, replay, `{"ids": ["a"]}`)
	require.Equal(t, http.StatusForbidden, status, body)
	require.Contains(t, body, "refused: not authorised: no operator signed in")
	// A GET changes nothing.
	status, _ = get(t, srv, replay)
	require.Equal(t, http.StatusMethodNotAllowed, status)
	require.Equal(t, []string{"a"}, waiting(t, b, onceflow.DefaultDeadLetterTopic), "nothing changed")

	// A selection that chooses nothing, or names an unknown field, is refused before anything.
	for _, sel := range []string{`{}`, `{"filter": {"reason": "bad"}}`, `{"ids": ["a"], "all": true}`, `{"idz": ["a"]}`} {
		status, body = post(t, srv, replay, sel, "X-Operator", "ann")
		require.Equal(t, http.StatusBadRequest, status, "%s: %s", sel, body)
	}
	status, body = post(t, srv, replay, `{"ids": ["a"]}`, "X-Operator", "ann")
	require.Equal(t, http.StatusOK, status, body)
	require.Empty(t, waiting(t, b, onceflow.DefaultDeadLetterTopic))
	require.Equal(t, []string{"a"}, waiting(t, b, "orders"))
}

func TestConsole_WhatMessagesCarryIsDataNeverMarkup(t *testing.T) {
	t.Parallel()
	b := queue(t)
	const xss = `<script>alert("owned")</script><img src=x onerror=alert(1)>`
	deadLetter(t, b, "id-"+xss, "orders", "permanent: "+xss, xss)
	srv := mount(t, newConsole(t, console.Config{Broker: b}))

	for _, path := range []string{"/ops/api/dead-letters", "/ops/api/dead-letter?id=" + urlQuery("id-"+xss)} {
		status, body := get(t, srv, path)
		require.Equal(t, http.StatusOK, status, body)
		require.NotContains(t, body, "<script>", path)
		require.NotContains(t, body, "<img", path)
		require.Contains(t, body, `\u003cscript\u003ealert(\"owned\")\u003c/script\u003e`, path)
	}
	var one struct {
		ID            string  `json:"id"`
		Reason        string  `json:"reason"`
		PayloadFormat string  `json:"payload_format"`
		PayloadText   *string `json:"payload_text"`
	}
	getJSON(t, srv, "/ops/api/dead-letter?id="+urlQuery("id-"+xss), &one)
	require.Equal(t, "id-"+xss, one.ID, "decoded, the values are the message's own")
	require.Equal(t, "permanent: "+xss, one.Reason)
	require.Equal(t, "text", one.PayloadFormat)
	require.Equal(t, xss, *one.PayloadText)
}

func urlQuery(s string) string {
	return strings.NewReplacer("%", "%25", "&", "%26", "+", "%2B", "#", "%23", " ", "%20", "<", "%3C", ">", "%3E", `"`, "%22", "=", "%3D").Replace(s)
}

// listDoc is the part of api/dead-letters the tests read.
type listDoc struct {
	DeadLetters []struct {
		ID             string `json:"id"`
		Reason         string `json:"reason"`
		DeliveryLimit  bool   `json:"delivery_limit"`
		PayloadPreview string `json:"payload_preview"`
	} `json:"dead_letters"`
	Matched int  `json:"matched"`
	More    bool `json:"more"`
}

func (l listDoc) ids() []string {
	out := []string{}
	for _, d := range l.DeadLetters {
		out = append(out, d.ID)
	}
	return out
}

type reportDoc struct {
	Done []struct {
		ID string `json:"id"`
		To string `json:"to"`
	} `json:"done"`
	Failed []struct {
		ID    string `json:"id"`
		Error string `json:"error"`
	} `json:"failed"`
	Kept     int      `json:"kept"`
	NotFound []string `json:"not_found"`
	Error    string   `json:"error"`
}

func TestConsole_ListsFindsAndReplaysDeadLettersReportingEachOne(t *testing.T) {
	t.Parallel()
	b := queue(t)
	deadLetter(t, b, "a", "orders", "permanent: account 7 is closed", `{"n": 1}`)
	deadLetter(t, b, "b", "orders", "permanent: delivery limit reached after 10 deliveries: timeout", "plain text")
	deadLetter(t, b, "c", "no such topic *", "permanent: account 7 is closed", "\x00\xff\x10")
	deadLetter(t, b, "d", "orders", "permanent: account 7 is closed", `{"n": 4}`)
	var audit strings.Builder
	srv := mount(t, newConsole(t, console.Config{Broker: b, Authorize: allow, Logger: slog.New(slog.NewTextHandler(&audit, nil))}))

	var page listDoc
	getJSON(t, srv, "/ops/api/dead-letters?limit=2", &page)
	require.Equal(t, []string{"a", "b"}, page.ids())
	require.Equal(t, 4, page.Matched)
	require.True(t, page.More)
	require.True(t, page.DeadLetters[1].DeliveryLimit)
	getJSON(t, srv, "/ops/api/dead-letters?reason=account+7&offset=1", &page)
	require.Equal(t, []string{"c", "d"}, page.ids())
	require.Equal(t, "00 ff 10", page.DeadLetters[0].PayloadPreview, "a payload that is not text is previewed in hex")
	status, body := get(t, srv, "/ops/api/dead-letters?since=yesterday")
	require.Equal(t, http.StatusBadRequest, status)
	require.Contains(t, body, "want an RFC 3339 time")
	getJSON(t, srv, "/ops/api/dead-letters?since="+time.Now().Add(-time.Hour).UTC().Format(time.RFC3339)+"&handler=ledger&topic=orders", &page)
	require.Equal(t, []string{"a", "b", "d"}, page.ids())

	for id, format := range map[string]string{"a": "json", "b": "text", "c": "binary"} {
		var one struct {
			PayloadFormat string `json:"payload_format"`
			PayloadBase64 string `json:"payload_base64"`
		}
		getJSON(t, srv, "/ops/api/dead-letter?id="+id, &one)
		require.Equal(t, format, one.PayloadFormat, id)
	}
	status, _ = get(t, srv, "/ops/api/dead-letter?id=nope")
	require.Equal(t, http.StatusNotFound, status)

	// Everything the reason matches, by the ids the operator confirmed: c cannot go back to
	// its topic, and the others are replayed all the same.
	status, body = post(t, srv, "/ops/api/dead-letters/replay", `{"ids": ["a", "c", "d", "gone"], "exact": true, "filter": {"reason": "account 7"}}`)
	require.Equal(t, http.StatusOK, status, body)
	var rep reportDoc
	require.NoError(t, json.Unmarshal([]byte(body), &rep))
	require.Len(t, rep.Done, 2)
	require.Equal(t, "a", rep.Done[0].ID)
	require.Equal(t, "orders", rep.Done[0].To)
	require.Equal(t, "d", rep.Done[1].ID)
	require.Len(t, rep.Failed, 1)
	require.Equal(t, "c", rep.Failed[0].ID)
	require.Contains(t, rep.Failed[0].Error, "invalid topic name")
	require.Equal(t, 1, rep.Kept, "b was not chosen")
	require.Equal(t, []string{"gone"}, rep.NotFound)
	require.Contains(t, rep.Error, `1 of 3 chosen dead letters not replayed; the first, "c"`)
	require.Equal(t, []string{"a", "d"}, waiting(t, b, "orders"))
	require.Equal(t, []string{"b", "c"}, waiting(t, b, onceflow.DefaultDeadLetterTopic))
	require.Regexp(t, `level=INFO msg="console: dead letters replayed" remote=127\.0\.0\.1:\d+ topic=onceflow_dead_letter group=onceflow ids=4 all=false reason="account 7" done=2 failed=1 not_found=1 error=`, audit.String())

	status, body = post(t, srv, "/ops/api/dead-letters/delete", `{"all": true, "filter": {"handler": "ledger"}}`)
	require.Equal(t, http.StatusOK, status, body)
	rep = reportDoc{}
	require.NoError(t, json.Unmarshal([]byte(body), &rep))
	require.Len(t, rep.Done, 2)
	require.Empty(t, rep.Error)
	require.Empty(t, waiting(t, b, onceflow.DefaultDeadLetterTopic))
}

// handlersDoc is the part of api/handlers the tests read.
type handlersDoc struct {
	Source   string `json:"source"`
	Handlers []struct {
		Name  string `json:"name"`
		Topic string `json:"topic"`
		QoS   string `json:"qos"`
		State *struct {
			Kind string `json:"kind"`
		} `json:"state"`
		InFlight      *int       `json:"in_flight"`
		Rate          *float64   `json:"rate"`
		Processed     *int64     `json:"processed"`
		Duplicates    *int64     `json:"duplicates"`
		DeadLettered  *int64     `json:"dead_lettered"`
		DeliveryLimit *int64     `json:"delivery_limit"`
		Applied       *int64     `json:"applied"`
		LastApplied   *time.Time `json:"last_applied"`
		Redelivered   *int64     `json:"redelivered"`
	} `json:"handlers"`
}

func TestConsole_MountedInTheServiceShowsTheRoutersHandlers(t *testing.T) {
	t.Parallel()
	b := queue(t)
	db := testsvc.SQLite(t)
	r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: b.Publisher(), PurgeInterval: -1, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	sub, err := b.Subscriber()
	require.NoError(t, err)
	require.NoError(t, r.AddHandler(onceflow.Handler{Name: "ledger", Topic: "payments", Subscriber: sub, DB: db, QoS: onceflow.ExactlyOnce,
		Processor: processor.Func(func(_ context.Context, msg *messagedata.MessageData) error {
			if !json.Valid(msg.Payload) {
				return processor.Permanent(errors.New("not JSON"))
			}
			return nil
		})}))
	testsvc.StartRouter(t, r)
	srv := mount(t, newConsole(t, console.Config{Router: r, Broker: b, DB: db}))

	for i := range 5 {
		require.NoError(t, b.Publisher().Publish("payments", message.NewMessage(fmt.Sprintf("p-%d", i), []byte(`{}`))))
	}
	require.NoError(t, b.Publisher().Publish("payments", message.NewMessage("p-0", []byte(`{}`)), message.NewMessage("bad", []byte(`x`))))
	var doc handlersDoc
	testsvc.Eventually(t, 30*time.Second, func() bool {
		getJSON(t, srv, "/ops/api/handlers", &doc)
		return len(doc.Handlers) == 1 && *doc.Handlers[0].Processed == 5 && *doc.Handlers[0].DeadLettered == 1 && *doc.Handlers[0].Duplicates == 1
	}, "the handler's counts never showed its 7 deliveries")
	h := doc.Handlers[0]
	require.Equal(t, "router", doc.Source)
	require.Equal(t, "ledger", h.Name)
	require.Equal(t, "payments", h.Topic)
	require.Equal(t, "ExactlyOnce", h.QoS)
	require.Equal(t, "running", h.State.Kind)
	require.Zero(t, *h.InFlight)
	require.Zero(t, *h.DeliveryLimit)
	require.Nil(t, h.Applied, "the database's view is for a console beside the service")
	require.NotNil(t, h.Rate)

	var page listDoc
	getJSON(t, srv, "/ops/api/dead-letters?reason=not+JSON", &page)
	require.Equal(t, []string{"bad"}, page.ids())
}

func TestConsole_BesideTheServiceReadsHandlersAndStorageFromTheDatabase(t *testing.T) {
	t.Parallel()
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db := d.Open(t)
			srv := mount(t, newConsole(t, console.Config{DB: db}))

			// An empty database: no handlers, no tables.
			var doc handlersDoc
			getJSON(t, srv, "/ops/api/handlers", &doc)
			require.Equal(t, "database", doc.Source)
			require.Empty(t, doc.Handlers)
			var st storageDoc
			getJSON(t, srv, "/ops/api/storage", &st)
			require.Nil(t, st.Dedup)
			require.Nil(t, st.Outbox)
			require.Empty(t, st.Errors)

			// What a router leaves: claims, keys, delivery counts, a purge, an outbox backlog.
			store, err := dedup.New(db, dedup.Config{})
			require.NoError(t, err)
			require.NoError(t, store.Migrate(ctx))
			require.NoError(t, store.ClaimHandler(ctx, "ledger", "payments"))
			tx, err := db.BeginTxx(ctx, nil)
			require.NoError(t, err)
			for i := range 3 {
				_, err := store.Record(ctx, tx, dedup.Key{Handler: "ledger", MessageID: fmt.Sprintf("p-%d", i)}, "")
				require.NoError(t, err)
			}
			require.NoError(t, tx.Commit())
			_, err = store.Purge(ctx, dedup.PurgeOptions{})
			require.NoError(t, err)
			counter, err := dedup.NewCounter(db, dedup.CounterConfig{})
			require.NoError(t, err)
			require.NoError(t, counter.Migrate(ctx))
			require.NoError(t, counter.MarkDeadLettered(ctx, "ledger", "p-9"))
			ob, err := outbox.New(db, outbox.Config{})
			require.NoError(t, err)
			require.NoError(t, ob.Migrate(ctx))
			otx, err := db.BeginTx(ctx, nil)
			require.NoError(t, err)
			require.NoError(t, ob.PublishTx(ctx, otx, "shipments", message.NewMessage("s-1", []byte(`{}`))))
			require.NoError(t, otx.Commit())

			// A second console, whose caches are empty, with the broker of the dead letters.
			b := queue(t)
			deadLetter(t, b, "p-8", "payments", "permanent: delivery limit reached after 10 deliveries: timeout", `{}`)
			deadLetter(t, b, "p-9", "payments", "permanent: bad", `{}`)
			srv = mount(t, newConsole(t, console.Config{DB: db, Broker: b}))
			getJSON(t, srv, "/ops/api/handlers", &doc)
			require.Len(t, doc.Handlers, 1)
			h := doc.Handlers[0]
			require.Equal(t, "ledger", h.Name)
			require.Equal(t, "payments", h.Topic)
			require.Nil(t, h.State, "a console beside the service cannot know the state")
			require.Nil(t, h.InFlight)
			require.Nil(t, h.Processed)
			require.EqualValues(t, 3, *h.Applied)
			require.InDelta(t, 3.0/60, *h.Rate, 1e-9, "applied in the last minute")
			require.WithinDuration(t, time.Now(), *h.LastApplied, time.Minute)
			require.EqualValues(t, 0, *h.Redelivered)
			require.EqualValues(t, 1, *h.DeadLettered)
			require.EqualValues(t, 1, *h.DeliveryLimit, "a dead letter waiting was given up at the limit")

			getJSON(t, srv, "/ops/api/storage", &st)
			require.Empty(t, st.Errors)
			require.Equal(t, "onceflow_dedup", st.Dedup.Table)
			require.EqualValues(t, 3, st.Dedup.Rows)
			require.Zero(t, st.Dedup.Expired)
			require.NotNil(t, st.Dedup.Oldest)
			require.NotNil(t, st.Dedup.LastPurge)
			require.WithinDuration(t, time.Now(), st.Dedup.LastPurge.At, time.Minute)
			require.Zero(t, st.Dedup.LastPurge.Deleted)
			require.Equal(t, "onceflow_outbox", st.Outbox.Table)
			require.EqualValues(t, 1, st.Outbox.Waiting)
			require.NotNil(t, st.Outbox.Oldest)
		})
	}
}

type storageDoc struct {
	Database string `json:"database"`
	Dedup    *struct {
		Table     string     `json:"table"`
		Rows      int64      `json:"rows"`
		Expired   int64      `json:"expired"`
		Oldest    *time.Time `json:"oldest"`
		LastPurge *struct {
			At      time.Time `json:"at"`
			Deleted int64     `json:"deleted"`
		} `json:"last_purge"`
	} `json:"dedup"`
	Outbox *struct {
		Table   string     `json:"table"`
		Waiting int64      `json:"waiting"`
		Oldest  *time.Time `json:"oldest"`
	} `json:"outbox"`
	Errors []string `json:"errors"`
}

func TestConsole_ShowsNoPasswordOfAnyURL(t *testing.T) {
	t.Parallel()
	const secret = "s3cr3t-pw"
	// PostgreSQL here trusts loopback connections: the password is not checked, only carried.
	raw := strings.Replace(testsvc.PostgresURL(t), "postgres@", "postgres:"+secret+"@", 1)
	db, err := sqldb.Open(context.Background(), raw)
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	srv := mount(t, newConsole(t, console.Config{DB: db, Broker: queue(t)}))
	for _, path := range []string{"/ops/", "/ops/api/info", "/ops/api/storage", "/ops/api/handlers", "/ops/api/dead-letters"} {
		_, body := get(t, srv, path)
		require.NotContains(t, body, secret, path)
	}
	var info struct {
		Database string `json:"database"`
	}
	getJSON(t, srv, "/ops/api/info", &info)
	require.Contains(t, info.Database, "postgres:xxxxx@127.0.0.1")
}

func TestConsole_InvalidConfigurationIsAnErrorNamingTheField(t *testing.T) {
	t.Parallel()
	_, err := console.New(console.Config{DedupTable: "no such table"})
	require.ErrorContains(t, err, "console: Config.DedupTable")
	_, err = console.New(console.Config{ScanLimit: -1})
	require.ErrorContains(t, err, "console: Config.ScanLimit: -1 is negative")
}

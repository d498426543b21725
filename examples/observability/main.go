// Observability runs an exactly-once service with its telemetry switched on: metrics exposed
// on /metrics through the OpenTelemetry Prometheus exporter, traces written to stdout, and
// structured logs through log/slog.
//
// The service consumes orders from the embedded SQLite queue, records each in the application
// database and writes a shipment to the transactional outbox in the same transaction; an
// outbox relay sends the shipments to the queue, and a second handler consumes them. The trace
// of an order therefore goes producer -> orders handler -> outbox -> relay -> shipments
// handler. The producer sends a few orders that exercise every outcome: one is delivered
// twice (duplicate), one fails once (retry), one is invalid (dead letter).
//
//	go run ./examples/observability                         # metrics on 127.0.0.1:9464
//	go run ./examples/observability -db 'postgres://postgres@127.0.0.1:5432/test?sslmode=disable'
//	curl -s 127.0.0.1:9464/metrics | grep '^onceflow_'
//
// docs/observability.md lists every metric and span; docs/grafana-dashboard.json is a
// dashboard for these metrics.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel"
	promexporter "go.opentelemetry.io/otel/exporters/prometheus"
	"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker/sqlitequeue"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
	_ "github.com/onceflow/onceflow/sqldb/mysql"
	_ "github.com/onceflow/onceflow/sqldb/postgres"
	_ "github.com/onceflow/onceflow/sqldb/sqlite"
)

const (
	ordersTopic    = "orders"
	shipmentsTopic = "shipments"
	// scope is the instrumentation scope onceflow's own metrics use.
	scope = "github.com/onceflow/onceflow"
)

// Options configures a run of the service.
type Options struct {
	// Addr is the listen address of the /metrics endpoint; port 0 picks a free port.
	Addr string
	// Dir holds the queue, and the application database unless DBURL names one.
	Dir string
	// DBURL is the application database's URL; empty for app.db in Dir.
	DBURL string
	// Orders is how many orders the producer sends, besides the duplicate, failing and
	// invalid ones.
	Orders int
	// Traces receives the spans as JSON (stdout by default).
	Traces io.Writer
	// Logger receives the structured logs.
	Logger *slog.Logger
	// Listening, when set, is called with the endpoint's address once it accepts requests.
	Listening func(addr string)
}

func main() {
	opts := Options{Traces: os.Stdout}
	flag.StringVar(&opts.Addr, "addr", "127.0.0.1:9464", "listen address of the /metrics endpoint")
	flag.StringVar(&opts.Dir, "dir", "", "directory of the queue and database files (default: a new temporary directory)")
	flag.StringVar(&opts.DBURL, "db", "", "database URL: postgres://..., mysql://... (default: app.db beside the queue)")
	flag.IntVar(&opts.Orders, "orders", 5, "number of ordinary orders to send")
	flag.Parse()
	opts.Logger = slog.New(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	removeDir := func() {}
	if opts.Dir == "" {
		dir, err := os.MkdirTemp("", "onceflow-observability-")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		opts.Dir = dir
		removeDir = func() { _ = os.RemoveAll(dir) }
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := Run(ctx, opts)
	stop()
	removeDir()
	if err != nil {
		fmt.Fprintln(os.Stderr, "observability:", err)
		os.Exit(1)
	}
}

// order is the payload of an order message.
type order struct {
	Amount int `json:"amount"`
}

// Run starts the service and blocks until ctx ends.
func Run(ctx context.Context, opts Options) (err error) {
	logger := opts.Logger
	if logger == nil {
		logger = slog.Default()
	}
	res := resource.NewSchemaless(semconv.ServiceName("onceflow-observability"))

	// Traces: every span to stdout. The propagator writes and reads the W3C traceparent header,
	// so the trace crosses the queue and the outbox.
	exporter, err := stdouttrace.New(stdouttrace.WithWriter(opts.Traces))
	if err != nil {
		return err
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithResource(res), sdktrace.WithBatcher(exporter))
	defer func() { err = errors.Join(err, tp.Shutdown(context.WithoutCancel(ctx))) }()
	otel.SetTracerProvider(tp)
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))

	// Metrics: a Prometheus registry read by /metrics, fed by the OpenTelemetry exporter.
	registry := prometheus.NewRegistry()
	registry.MustRegister(collectors.NewGoCollector())
	reader, err := promexporter.New(promexporter.WithRegisterer(registry))
	if err != nil {
		return err
	}
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithResource(res), sdkmetric.WithReader(reader))
	defer func() { err = errors.Join(err, mp.Shutdown(context.WithoutCancel(ctx))) }()
	otel.SetMeterProvider(mp)

	queue, err := sqlitequeue.Open(ctx, "sqlite://"+filepath.Join(opts.Dir, "queue.db"), sqlitequeue.Config{ConsumerGroup: "observability"})
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, queue.Close()) }()
	dbURL := opts.DBURL
	if dbURL == "" {
		dbURL = "sqlite://" + filepath.Join(opts.Dir, "app.db")
	}
	db, err := sqldb.Open(ctx, dbURL)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, db.Close()) }()
	if _, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS orders (order_id VARCHAR(64) NOT NULL, amount BIGINT NOT NULL)`); err != nil {
		return err
	}

	ob, err := outbox.New(db, outbox.Config{})
	if err != nil {
		return err
	}
	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: db, Publisher: queue.Publisher(), Logger: logger, PollInterval: 50 * time.Millisecond})
	if err != nil {
		return err
	}
	gauges, err := relay.RegisterMetrics(mp.Meter(scope))
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, gauges.Unregister()) }()

	// The router uses the global providers and propagator set above.
	router, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: queue.Publisher(), Logger: logger})
	if err != nil {
		return err
	}
	router.AddMigration(ob.Migrate)
	var flaky atomic.Bool
	ordersSub, err := queue.Subscriber()
	if err != nil {
		return err
	}
	err = router.AddHandler(onceflow.Handler{
		Name:            "orders",
		Topic:           ordersTopic,
		Subscriber:      ordersSub,
		DB:              db,
		QoS:             onceflow.ExactlyOnce,
		MessagingSystem: "sqlite",
		Retry:           middleware.Retry{InitialInterval: 10 * time.Millisecond},
		Processor: processor.JSON(func(ctx context.Context, msg *messagedata.MessageData, o order) error {
			if o.Amount < 0 {
				return processor.Permanent(fmt.Errorf("order %s: amount %d is negative", msg.ID, o.Amount))
			}
			if msg.ID == "order-flaky" && flaky.CompareAndSwap(false, true) {
				return errors.New("inventory service unavailable") // the retry succeeds
			}
			tx, _ := processor.TxFromContext(ctx)
			if _, err := tx.ExecContext(ctx, tx.Rebind(`INSERT INTO orders (order_id, amount) VALUES (?, ?)`), msg.ID, o.Amount); err != nil {
				return err
			}
			shipment := message.NewMessage(outbox.DerivedID(msg.ID, "shipment"), []byte(fmt.Sprintf(`{"order":%q}`, msg.ID)))
			return ob.Publish(ctx, shipmentsTopic, shipment)
		}),
	})
	if err != nil {
		return err
	}
	shipmentsSub, err := queue.Subscriber()
	if err != nil {
		return err
	}
	err = router.AddHandler(onceflow.Handler{
		Name:            "shipments",
		Topic:           shipmentsTopic,
		Subscriber:      shipmentsSub,
		DB:              db,
		QoS:             onceflow.ExactlyOnce,
		MessagingSystem: "sqlite",
		Processor:       processor.Func(func(context.Context, *messagedata.MessageData) error { return nil }),
	})
	if err != nil {
		return err
	}

	ln, err := net.Listen("tcp", opts.Addr)
	if err != nil {
		return err
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(registry, promhttp.HandlerOpts{}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve(ln) }()
	defer func() {
		shutdownCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		err = errors.Join(err, srv.Shutdown(shutdownCtx))
	}()
	logger.Info("serving metrics", "addr", "http://"+ln.Addr().String()+"/metrics")
	if opts.Listening != nil {
		opts.Listening(ln.Addr().String())
	}

	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(ctx) }()
	select {
	case <-router.Running():
	case err := <-routerDone:
		return err
	}
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(ctx) }()

	if err := produce(ctx, queue.Publisher(), opts.Orders); err != nil {
		return errors.Join(err, <-routerDone, <-relayDone)
	}

	select {
	case <-ctx.Done():
	case err := <-serveErr:
		logger.Error("metrics endpoint stopped", "error", err)
	}
	return errors.Join(<-routerDone, <-relayDone)
}

// produce sends the orders, each in a producer span whose context goes into the headers, as a
// traced producer does.
func produce(ctx context.Context, pub message.Publisher, n int) error {
	tracer := otel.Tracer("example-producer")
	send := func(id string, amount int) error {
		ctx, span := tracer.Start(ctx, "send "+ordersTopic, trace.WithSpanKind(trace.SpanKindProducer))
		defer span.End()
		payload, _ := json.Marshal(order{Amount: amount})
		msg := message.NewMessage(id, payload)
		otel.GetTextMapPropagator().Inject(ctx, propagation.MapCarrier(msg.Metadata))
		return pub.Publish(ordersTopic, msg)
	}
	for i := 1; i <= n; i++ {
		if err := send(fmt.Sprintf("order-%d", i), 10*i); err != nil {
			return err
		}
	}
	for _, m := range []struct {
		id     string
		amount int
	}{
		{"order-1", 10},       // a redelivery: duplicate
		{"order-flaky", 7},    // fails once, retried in process
		{"order-invalid", -5}, // dead-lettered
	} {
		if err := send(m.id, m.amount); err != nil {
			return err
		}
	}
	return nil
}

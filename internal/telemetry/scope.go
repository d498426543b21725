package telemetry

import (
	"runtime/debug"
	"sync"

	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"
)

// modulePath is the module whose version the instrumentation scope carries.
const modulePath = "github.com/onceflow/onceflow"

// Version returns the version of the onceflow module in the running binary, as the Go toolchain
// recorded it ("v1.2.3", a pseudo-version, or "(devel)" when onceflow is the main module built
// from a checkout); "" when the binary has no build information.
var Version = sync.OnceValue(func() string {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return ""
	}
	if info.Main.Path == modulePath {
		return info.Main.Version
	}
	for _, d := range info.Deps {
		if d.Path == modulePath {
			if d.Replace != nil && d.Replace.Version != "" {
				return d.Replace.Version
			}
			return d.Version
		}
	}
	return ""
})

// Tracer returns onceflow's tracer from tp: the instrumentation scope ScopeName with the
// module's version and the schema URL of the semantic conventions its spans follow.
func Tracer(tp trace.TracerProvider) trace.Tracer {
	return tp.Tracer(ScopeName, trace.WithInstrumentationVersion(Version()), trace.WithSchemaURL(semconv.SchemaURL))
}

// Meter returns onceflow's meter from mp, with the scope of Tracer.
func Meter(mp metric.MeterProvider) metric.Meter {
	return mp.Meter(ScopeName, metric.WithInstrumentationVersion(Version()), metric.WithSchemaURL(semconv.SchemaURL))
}

// Cosine similarity of two sentences with llamadeploy's /v1/embeddings, using only the JDK (Java 17+).
// Asks for base64 (little-endian float32, as OpenAI's clients do by default) and decodes it here.
// Run:  java Embeddings.java "A cat sits on the mat." "A kitten is on the rug."
// Env:  LLAMADEPLOY_URL (default http://127.0.0.1:8000/v1), LLAMADEPLOY_MODEL (default all-minilm-l6-v2),
//       LLAMADEPLOY_API_KEY (optional).
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Base64;
import java.util.List;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

public class Embeddings {
    private static final Pattern EMBEDDING = Pattern.compile("\"embedding\":\\s*\"([A-Za-z0-9+/=]*)\"");

    public static void main(String[] args) throws Exception {
        String base = System.getenv().getOrDefault("LLAMADEPLOY_URL", "http://127.0.0.1:8000/v1");
        String model = System.getenv().getOrDefault("LLAMADEPLOY_MODEL", "all-minilm-l6-v2");
        String key = System.getenv("LLAMADEPLOY_API_KEY");
        String a = args.length > 0 ? args[0] : "A cat sits on the mat.";
        String b = args.length > 1 ? args[1] : "A kitten is lying on the rug.";

        String body = "{\"model\":" + quote(model) + ",\"encoding_format\":\"base64\",\"input\":["
                + quote(a) + "," + quote(b) + "]}";
        HttpRequest.Builder request = HttpRequest.newBuilder(URI.create(base + "/embeddings"))
                .timeout(Duration.ofMinutes(2))
                .header("Content-Type", "application/json")
                .POST(HttpRequest.BodyPublishers.ofString(body));
        if (key != null && !key.isEmpty()) {
            request.header("Authorization", "Bearer " + key);
        }
        HttpClient client = HttpClient.newBuilder().connectTimeout(Duration.ofSeconds(10)).build();
        HttpResponse<String> response = client.send(request.build(), HttpResponse.BodyHandlers.ofString());
        if (response.statusCode() != 200) {
            System.err.println("HTTP " + response.statusCode() + ": " + response.body());
            System.exit(1);
        }
        List<float[]> vectors = new ArrayList<>();
        Matcher m = EMBEDDING.matcher(response.body());
        while (m.find()) {
            vectors.add(decode(m.group(1)));
        }
        if (vectors.size() != 2) {
            System.err.println("expected 2 embeddings, got " + vectors.size() + ": " + response.body());
            System.exit(1);
        }
        System.out.println("dimensions: " + vectors.get(0).length);
        System.out.printf("cosine: %.6f%n", cosine(vectors.get(0), vectors.get(1)));
    }

    /** The floats of a base64 string of little-endian float32 values. */
    static float[] decode(String b64) {
        ByteBuffer bytes = ByteBuffer.wrap(Base64.getDecoder().decode(b64)).order(ByteOrder.LITTLE_ENDIAN);
        float[] out = new float[bytes.remaining() / 4];
        bytes.asFloatBuffer().get(out);
        return out;
    }

    static double cosine(float[] x, float[] y) {
        double dot = 0, nx = 0, ny = 0;
        for (int i = 0; i < x.length; i++) {
            dot += x[i] * y[i];
            nx += x[i] * x[i];
            ny += y[i] * y[i];
        }
        return dot / Math.sqrt(nx * ny);
    }

    /** A JSON string literal for {@code s}. */
    static String quote(String s) {
        StringBuilder out = new StringBuilder("\"");
        for (char c : s.toCharArray()) {
            switch (c) {
                case '"' -> out.append("\\\"");
                case '\\' -> out.append("\\\\");
                case '\n' -> out.append("\\n");
                case '\r' -> out.append("\\r");
                case '\t' -> out.append("\\t");
                default -> {
                    if (c < 0x20) out.append(String.format("\\u%04x", (int) c));
                    else out.append(c);
                }
            }
        }
        return out.append('"').toString();
    }
}
